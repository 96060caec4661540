"""What a running network shows of itself, on whole nodes in one process (``testing.memnet``):
each learner's tokens/s in its presence and status file, and the stall indicator when the
committee cannot certify."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from p2pdiloco.runtime.status import short_peer
from p2pdiloco.testing.memnet import MemoryNetwork

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_learners_announce_their_tokens_per_second(tmp_path: Path) -> None:
    async def main() -> None:
        async with MemoryNetwork(tmp_path, nodes=2) as net:
            peers = [n.peer_id for n in net.nodes]
            await net.wait_for(
                lambda: all(
                    p in net.directory.presence and net.directory.presence[p].throughput_tps > 0
                    for p in peers
                ),
                60,
                "every learner's presence to carry a training rate",
            )
            node = net.nodes[0]
            assert node.trainer is not None
            await node.runtime.write_status()
            status = json.loads((tmp_path / node.name / "status.json").read_text())
            assert status["tokens_per_second"] > 0 and status["stalled"] is None

    asyncio.run(main())


def test_a_committee_that_cannot_certify_shows_stalled_within_grace_plus_timeout(
    tmp_path: Path,
) -> None:
    grace, agree = 2.0, 1.0

    async def main() -> None:
        rules = {"grace": grace, "agree_timeout": agree}
        async with MemoryNetwork(tmp_path, nodes=4, rules=rules) as net:
            gone = net.nodes[2:]  # 2 of 4 syncers: the quorum of 3 cannot be reached
            for node in gone:
                await net.stop(node)
            watcher = net.nodes[0]
            await net.wait_for(
                lambda: watcher.runtime.tally.waiting_since is not None, 60, "a send"
            )
            sent_at = watcher.runtime.tally.waiting_since
            assert sent_at is not None
            await net.wait_for(
                lambda: watcher.runtime.view.stalled is not None, grace + agree + 10, "stalled"
            )
            seen_after = time.monotonic() - sent_at
            view = watcher.runtime.view
            assert view.version == 0 and seen_after < grace + agree + 3
            assert view.stalled is not None
            assert view.stalled.startswith("stalled: no certificate for version 1 for ")
            for node in net.nodes:  # the whole committee is named; the stopped ones as such
                assert short_peer(node.peer_id) in view.stalled
            # Unreachable members are named once the delivery in flight has tried them.
            unreachable = view.stalled.partition("unreachable: ")[2]
            assert all(short_peer(n.peer_id) not in unreachable for n in net.nodes[:2])
            assert any(e.endswith(view.stalled) for e in view.events)
            # ... and its heartbeat says so: `status` and the bootstrap page show the run stalled.
            await net.wait_for(
                lambda: net.directory.presence[watcher.peer_id].stalled_s > 0, 10, "presence"
            )

            for node in gone:  # the committee is whole again: a certificate ends the stall
                await net.restart(node)
            await net.wait_for(lambda: watcher.version >= 1, 90, "version 1 after the restart")
            await net.wait_for(lambda: watcher.runtime.view.stalled is None, 5, "stall cleared")
            await net.wait_for(
                lambda: net.directory.presence[watcher.peer_id].stalled_s == 0, 10, "presence"
            )

    asyncio.run(main())
