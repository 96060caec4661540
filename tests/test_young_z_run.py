"""A young run under the z test, in whole runtimes (ADR 0071): its rounds close on the founder's
delta, never on newcomers' alone, so it certifies from its first round; a newcomer is refused
saying why, and nobody is credited while no stretch can show work."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.protocol.records import WorkScoring
from p2pdiloco.testing.memnet import MemoryNetwork
from tests.test_runtime_memory import check_chains, run

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

# A z test no delta passes (z > 100): the run stays young throughout, as a run's first versions
# are (ADR 0070: from random initialisation no stretch shows work at z > 3 on long rows; these
# 8-row stretches of a small corpus sometimes do).
Z = WorkScoring(z_min=100.0, batches=2, rows=4)


def test_a_young_z_run_certifies_on_its_founders_deltas_and_tells_newcomers_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        rules = {"work": Z.model_dump(mode="json")}
        # Committee of 1: the genesis committee is the first node, the run's one founder, and
        # the slowest learner: the newcomers' deltas come first, every round.
        async with MemoryNetwork(
            tmp_path, nodes=3, committee_size=1, rules=rules, slowdown={0: 2.0}
        ) as net:
            await net.wait_for(lambda: net.min_version() >= 4, 240, "version 4 everywhere")
            check_chains(net)
            founder = net.nodes[0].peer_id
            newcomers = {n.peer_id for n in net.nodes[1:]}
            chain = net.live()[0].runtime.chain
            refused: list[str] = []
            for v in range(1, 5):
                body = parse_certificate(chain.certs[v], run_id=net.run_id).body
                # every version merged the founder's delta, uncredited; nobody else's
                assert [a.peer_id for a in body.accepted] == [founder], v
                assert not any(a.credited for a in body.accepted), v
                refused += [r.reason for r in body.rejected if r.peer_id in newcomers]
            assert refused, "newcomers' deltas were never in a round with the founder's"
            assert set(refused) == {"no advantage on its own data (young run: founders only)"}
            # No round closed on newcomers alone: such a round's merge fails (ADR 0071).
            failed = [r.getMessage() for r in caplog.records if "merge failed" in r.getMessage()]
            assert not failed, failed

    run(main())
