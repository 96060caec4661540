"""An island learner (rank 0 in this process, a real member process, gloo) against one
process, and an island that loses its member mid-stretch and re-forms (issue 13, CPU part)."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from p2pdiloco.island.leader import IslandBroken, generation_ranks
from p2pdiloco.island.learner import IslandLearner
from p2pdiloco.island.spec import IslandSpec
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.testing.memnet import _small_corpus
from p2pdiloco.train.data import PackedCorpus
from p2pdiloco.train.learner import Learner
from p2pdiloco.train.models import build_model, param_state

# Activation checkpointing on: the same delta, recomputed activations (the plan's choice for
# models whose activations do not fit).
ISLAND = IslandSpec(("cpu", "cpu"), threads=1, timeout_s=60, checkpointing=True)


Run = tuple[RunManifest, PackedCorpus, dict[str, torch.Tensor]]


def _run(batch: int) -> Run:
    creator = Identity.generate()
    _, manifest, _ = create_manifest(
        creator,
        name="island",
        model="gemma-tiny",
        data="embedded",
        seed=3,
        inner_steps=4,
        committee_size=1,
        genesis_committee=[creator.peer_id],
        inner={"batch_size": batch, "seq_len": 32, "warmup_steps": 2, "total_steps": 100},
    )
    gen = torch.Generator().manual_seed(5)  # a certified version that is not the init
    base = {
        n: t + 1e-3 * torch.randn(t.shape, generator=gen)
        for n, t in param_state(build_model("gemma-tiny", seed=3)).items()
    }
    return manifest, _small_corpus(), base


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diff = sum(float((a[n] - b[n]).double().square().sum()) for n in b)
    return math.sqrt(diff / sum(float(b[n].double().square().sum()) for n in b))


def test_an_island_learner_trains_the_delta_one_process_trains(
    tmp_path: Path, one_torch_thread: None
) -> None:
    manifest, corpus, base = _run(4)
    alone = Learner(manifest, corpus, "peer", base, device=torch.device("cpu"), base_version=1)
    island = IslandLearner(
        manifest, corpus, "peer", base, spec=ISLAND, log_dir=tmp_path, base_version=1
    )
    try:
        assert island.world == 2 and island.model.is_gradient_checkpointing
        assert _rel(island.params(), base) == 0.0  # the scatter loaded the version exactly
        one, both = alone.train(3), island.train(3)
        assert both.steps == one.steps == 3
        assert both.tokens == one.tokens == 3 * 4 * 32  # the island's: both ranks' rows
        d_alone = alone.outgoing(1, base, one.tokens, one.loss_last)
        d_island = island.outgoing(1, base, both.tokens, both.loss_last)
        # int8 payloads of nearly the same delta: compare what the learners kept instead
        rel = _rel(d_island.sent_params, d_alone.sent_params)
        delta = {n: base[n] - d_alone.sent_params[n] for n in base}
        moved = _rel({n: base[n] - d_island.sent_params[n] for n in base}, delta)
        print(f"island vs one process: parameters {rel:.2e}, delta {moved:.2e} relative L2")
        assert moved <= 1e-3  # the tolerance of tests/test_island.py, for the same reasons
        assert abs(both.loss_last - one.loss_last) < 1e-3
    finally:
        island.close()
    assert all(p.poll() is not None for p in island.island.members.values())


def test_generation_ranks_keep_the_step_batch_splitting_evenly() -> None:
    assert generation_ranks([1, 2, 3], 8) == {"0": 0, "1": 1, "2": 2, "3": 3}
    assert generation_ranks([2, 3], 8) == {"0": 0, "2": 1}  # 3 ranks would not split 8 rows
    assert generation_ranks([3], 6) == {"0": 0, "3": 1}
    assert generation_ranks([], 5) == {"0": 0}


def test_a_member_killed_mid_stretch_makes_the_others_re_form_and_train_on(
    tmp_path: Path, one_torch_thread: None
) -> None:
    manifest, corpus, base = _run(6)
    spec = IslandSpec(("cpu", "cpu", "cpu"), threads=1, timeout_s=60)
    island = IslandLearner(manifest, corpus, "peer", base, spec=spec, log_dir=tmp_path)
    try:
        assert island.world == 3
        victim = island.island.members[1]
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(victim.pid, signal.SIGKILL)

        timer = threading.Timer(1.0, kill)
        timer.start()
        with pytest.raises(IslandBroken, match="island member \\[1\\] stopped during 'train'"):
            island.train(500)  # minutes of steps: the kill lands mid-stretch
        broken_at = time.monotonic()
        timer.join()
        assert island.reform(base) == 2  # rank 0 and member 2, which kept its process
        print(
            f"kill → IslandBroken {broken_at - killed_at[0]:.2f} s, "
            f"re-form + load {time.monotonic() - broken_at:.2f} s"
        )
        assert island.steps_since_send == 0 and _rel(island.params(), base) == 0.0
        stats = island.train(2)
        assert stats.steps == 2 and stats.tokens == 2 * 6 * 32 and math.isfinite(stats.loss_last)
        assert _rel(island.params(), base) > 0
        log = (tmp_path / "island-member-2.log").read_text()
        assert "generation 1: rank 1 of 2" in log, log
    finally:
        island.close()
    assert all(p.poll() is not None for p in island.island.members.values())
