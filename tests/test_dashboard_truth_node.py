"""A real node's dashboard view moves through a training stretch (issue 39 item 4).

Three whole nodes in one process (``testing.memnet``: real runtimes, trainers, learners,
certificates) train with ``join``'s chunking, where a stretch of six steps is one chunk: the
case where the dashboard's count stood at 0/6 while the node trained. After every inner step
of the first node, its ``NodeView`` snapshot is taken on the training thread itself (no
sleeping, no sampling): the count moves step by step within the chunk, counts each stretch from
its own send, the next sync counts down, and the delta counts end as its certificates say.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from p2pdiloco.core.learner import LearnerPhase
from p2pdiloco.core.ledger import build_ledger
from p2pdiloco.dashboard.live import DashboardSnapshot
from p2pdiloco.runtime.node_view import NodeView
from p2pdiloco.runtime.status import RuntimeView
from p2pdiloco.runtime.trainer import Trainer, TrainerView
from p2pdiloco.testing.memnet import MemNode, MemoryNetwork

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

H = 6  # steps per delta: four does not divide it, so one chunk is the whole stretch
TRAINING = {LearnerPhase.TRAINING.value, LearnerPhase.IN_FLIGHT.value, LearnerPhase.OVERTIME.value}


class Running:
    """What ``NodeView`` reads of a ``RunningNode``: the runtime's and the trainer's views."""

    def __init__(self, node: MemNode, manifest: Any) -> None:
        self.node, self.manifest = node, manifest

    def views(self) -> tuple[RuntimeView, TrainerView | None]:
        trainer = self.node.trainer
        return self.node.runtime.view, trainer.view if trainer is not None else None


class Plane:
    """What ``NodeView`` reads of a ``Node``: its identity and the run."""

    def __init__(self, node: MemNode, run_id: str) -> None:
        self.node, self.run_id = node, run_id

    def snapshot(self) -> dict[str, Any]:
        me = self.node.peer_id
        return {
            "peer_id": me,
            "run_id": self.run_id,
            "run_name": "memnet",
            "model": "gemma-tiny",
            "reachability": "direct",
        }


def full_stretches(seen: list[DashboardSnapshot]) -> list[list[int]]:
    """The runs of snapshots whose count went 1, 2, …, H one step at a time. Overtime steps
    (trained past H while the certificate is awaited, shown at H) end a run but are none."""
    runs: list[list[int]] = []
    for s in seen:
        if runs and s.inner_step == runs[-1][-1] + 1:
            runs[-1].append(s.inner_step)
        else:
            runs.append([s.inner_step])
    return [r for r in runs if r == list(range(1, H + 1))]


def test_a_real_nodes_view_moves_step_by_step_through_each_stretch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[DashboardSnapshot] = []
    first: list[TrainerView] = []  # every trainer's view after each step of its first stretch
    start = Trainer.start

    def start_watched(trainer: Trainer) -> None:
        stepped = trainer.learner.on_step
        assert stepped is not None

        def watched(done: int) -> None:
            stepped(done)
            if trainer.machine.sent == 0:
                first.append(trainer.view)

        trainer.learner.on_step = watched
        start(trainer)

    monkeypatch.setattr(Trainer, "start", start_watched)

    async def main() -> None:
        async with MemoryNetwork(tmp_path, nodes=3, inner_steps=H, chunk=None) as net:
            n0 = net.nodes[0]
            trainer = n0.trainer
            assert trainer is not None and trainer.machine.chunk == H
            view = NodeView(Plane(n0, net.run_id), Running(n0, net.manifest))  # type: ignore[arg-type]
            stepped = trainer.learner.on_step
            assert stepped is not None

            def after_each_step(done: int) -> None:
                stepped(done)
                seen.append(view.snapshot())

            trainer.learner.on_step = after_each_step
            await net.wait_for(
                lambda: (
                    net.min_version() >= 2
                    and n0.runtime.view.accepted >= 1
                    and len(full_stretches(list(seen))) >= 2
                ),
                timeout=150,
                what="version 2, a delta of n0's merged, and two whole stretches seen",
            )
            trainer.learner.on_step = stepped
            final = view.snapshot()  # one runtime view: its version and counts agree
            # The certificates the node holds (its disk may lag: a worker thread writes them).
            held = n0.runtime.chain.certs
            certs = [held[v] for v in sorted(held) if v <= final.version]
            assert net.manifest is not None
            board = build_ledger(net.run_id, net.manifest, certs)
            mine = next((e for e in board.entries if e.peer_id == n0.peer_id), None)
            assert (final.accepted, final.rejected) == (
                (mine.accepted, mine.rejected) if mine is not None else (0, 0)
            )
            assert final.accepted >= 1

    asyncio.run(main())
    # A node training is shown training, at its speed, from its very first step: the first
    # chunk (a whole stretch, an hour on a 12B model) read "connecting", 0 tok/s, compute 0 %
    # until it ended (seen in stop 54's runs at the README's H = 50).
    assert len(first) >= 3 * H, len(first)  # every trainer's first stretch, from its 1st step
    assert all(v.phase in TRAINING for v in first), [v.phase for v in first]
    assert all(v.tokens_per_second > 0 and v.utilization > 0 for v in first), [
        (v.inner_step, v.tokens_per_second, v.utilization) for v in first
    ]
    assert all(s.state != "connecting" for s in seen)
    # Each chunk of H steps shows 1, 2, …, H as it trains: the count moves within the chunk.
    assert len(full_stretches(seen)) >= 2, [s.inner_step for s in seen]
    # Steps trained past a stretch while its certificate is awaited (a busy machine) are shown
    # as overtime at H, never as a stretch of their own.
    assert all(s.inner_step == H for s in seen if s.state.startswith("overtime"))
    # A stretch trained while the previous delta is in flight counts from that delta's send,
    # and the node is shown training, not only waiting.
    flying = [s for s in seen if s.state == "training, delta in flight"]
    assert flying and all(1 <= s.inner_step <= H for s in flying)
    assert any(s.waiting_on is not None and s.waiting_on.startswith("certificate") for s in flying)
    # The next sync counts down within a stretch (not frozen, never negative).
    etas = [s.eta_seconds for s in seen if s.inner_step < H and s.state.startswith("training")]
    assert etas and all(e is not None and e >= 0 for e in etas)
    by_stretch = [
        (a.eta_seconds, b.eta_seconds)
        for a, b in zip(seen, seen[1:], strict=False)
        if b.inner_step == a.inner_step + 1 < H and a.state == b.state
    ]
    assert by_stretch and sum(b < a for a, b in by_stretch if a and b) >= len(by_stretch) // 2
