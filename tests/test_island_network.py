"""An island in a run: whole nodes in one process (``testing.memnet``), one of them an island
whose member is a real process (gloo, FSDP2). The committee's certificates credit the island
as one learner with all its ranks' tokens; SIGKILLing the member mid-stretch makes rank 0
re-form alone and go on, and the run never waits for it (issue 13, CPU part)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from p2pdiloco.island.learner import IslandLearner
from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.testing.memnet import MemNode, MemoryNetwork
from tests.test_runtime_memory import check_chains

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]


def _credits(net: MemoryNetwork, peer: str, after: int = 0) -> list[tuple[int, int, int]]:
    """(version, steps, tokens) of every certificate past ``after`` that merged ``peer``."""
    out = []
    for v, raw in sorted(net.nodes[1].runtime.chain.certs.items()):
        cert = parse_certificate(raw, run_id=net.run_id)
        out += [
            (v, a.steps, a.tokens) for a in cert.body.accepted if a.peer_id == peer and v > after
        ]
    return out


def test_an_island_is_one_learner_in_the_certificate_and_re_forms_when_a_member_dies(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with MemoryNetwork(tmp_path, nodes=2, islands={0: 2}) as net:
            island: MemNode = net.nodes[0]
            assert island.trainer is not None
            learner = island.trainer.learner
            assert isinstance(learner, IslandLearner) and learner.world == 2
            assert net.manifest is not None
            inner = net.manifest.inner
            per_step = inner.batch_size * inner.seq_len  # both ranks' rows (one each)

            await net.wait_for(lambda: len(_credits(net, island.peer_id)) >= 1, 120, "a credit")
            for _, steps, tokens in _credits(net, island.peer_id):
                assert tokens == steps * per_step, "the island's tokens are all its ranks' rows"

            member = learner.island.members[1]
            os.kill(member.pid, signal.SIGKILL)
            killed_at = net.min_version()
            print(f"member killed at version {killed_at}")

            def re_formed() -> bool:
                return any("island re-formed with 1 ranks" in e for e in island.trainer.view.events)

            await net.wait_for(re_formed, 60, "rank 0 re-forms alone")
            await net.wait_for(
                lambda: len(_credits(net, island.peer_id, after=killed_at + 1)) >= 1,
                120,
                "a credit for the re-formed island",
            )
            assert learner.world == 1
            for _, steps, tokens in _credits(net, island.peer_id, after=killed_at + 1):
                assert tokens == steps * per_step
            events = [e for e in island.trainer.view.events if "island" in e]
            print("\n".join(events))
            check_chains(net)

        assert member.poll() is not None
        assert all(p.poll() is not None for p in learner.island.members.values())

    asyncio.run(main())
