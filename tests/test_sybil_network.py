"""Issue 14's Sybil flood against real processes: fresh identities cannot poison, shut out or sit.

Three honest nodes (the genesis committee, k = q = 3) train until they have earned trust on the
certified roster (``trust_min_accepted`` = ``trust_min_age`` = 2 here, so it takes three
versions); then five fresh identities send every syncer poisoned deltas (±0.05 per entry, about
a hundred times an honest delta's norm) with the largest claim a header may make, for every
version until the honest nodes reach version 9 (``p2pdiloco.harness.sybil``). With trust switched off
(``trust_min_accepted`` out of reach) this test fails: the flood fills the learner quorum and
is merged. The final eval loss against a clean run is a benchmark (bench/sybil_flood.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.core.trust import probation_room, trusted_peers
from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.sybil import flood
from p2pdiloco.protocol.identity import Identity
from tests.netutil import wait_for
from tests.test_sync_network import SMALL, certificates, verified_certificates

pytestmark = [pytest.mark.slow, pytest.mark.solo, pytest.mark.timeout(600)]

FLOOD_FROM, ROUNDS = 3, 6  # flood 6 versions from v3 (or wherever the nodes are by then)


def test_a_flood_of_fresh_identities_neither_poisons_nor_shuts_out_nor_sits(
    tmp_path: Path,
) -> None:
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(3)]
        run_id = net.publish_run(keys, trust_min_accepted=2, trust_min_age=2)
        nodes = [net.start_node(f"node{i}", k, until_version=100) for i, k in enumerate(keys)]

        # The flood starts once trust is in force: every honest node has earned it on the
        # certified roster. That takes three versions when all three trained from the start; a
        # node slowed at start takes longer (before trust is in force, fresh identities count
        # as trusted by design, and a flood then is merged: fc63 flooded at v3 with node0 yet
        # to contribute).
        def trust_in_force() -> int | None:
            certs = verified_certificates(nodes[0], run_id, net.manifest)
            if certs and trusted_peers(net.manifest, certs[-1]) is not None:
                return max(FLOOD_FROM, certs[-1].body.version)
            return None

        start = wait_for("trust in force on the certified roster", trust_in_force, 300)
        report = flood(net, run_id, nodes, count=5, start=start, rounds=ROUNDS)
        statuses = net.wait_versions(report.until, nodes, 300)

    honest = {k.peer_id for k in keys}
    fresh = set(report.sybils)
    certs = certificates(nodes[0], run_id)
    assert report.accepted >= 1, report.replies[:5]  # the flood got into rounds
    for c in certs:
        assert not fresh & set(c.body.committee), f"a fresh identity sat on v{c.body.version}"
    flooded = [c for c in certs if c.body.version > report.first_base + 1]
    assert len(flooded) >= ROUNDS - 1
    for c in flooded:
        merged = [a.peer_id for a in c.body.accepted]
        n_honest = sum(p in honest for p in merged)
        assert n_honest >= 2, f"v{c.body.version} merged {merged}"  # the quorum is trusted work
        assert sum(p in fresh for p in merged) <= probation_room(n_honest, 0.25)
        assert not fresh & set(merged), f"v{c.body.version} merged a poisoned delta"
    for peer in honest:  # nobody shut out
        assert sum(peer in {a.peer_id for a in c.body.accepted} for c in flooded) >= 2
    # No blow-up (the unscreened flood took it from 1.7 to 17.7). The last training loss is one
    # noisy batch per node, so only a large rise says anything; the eval loss against a clean
    # run is the benchmark's (bench/sybil_flood.py).
    loss_after = max(float(s["last_loss"]) for s in statuses)
    assert loss_after < 1.5 * report.loss_before, (report.loss_before, loss_after)
