"""Pieces of a gloo island (FSDP2 on CPU, ``torch.multiprocessing`` ranks): the rows each rank
trains, and a non-finite loss on one rank stopping every rank. The island's delta against one
process's, through the command channel, is in tests/test_island_learner.py."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from p2pdiloco.island.shards import Shards, enable_checkpointing, rank_rows, small_device
from p2pdiloco.train.configs import InnerConfig
from p2pdiloco.train.data import build_corpus, learner_batches
from p2pdiloco.train.inner import InnerStats
from p2pdiloco.train.model_specs import get_spec
from p2pdiloco.train.models import build_model, param_state
from p2pdiloco.train.tokenizer import load_tokenizer

CFG = InnerConfig(lr=3e-3, warmup_steps=2, total_steps=40, batch_size=4, seq_len=32)
STEPS, SEED = 3, 7


def _batches() -> torch.Tensor:
    corpus = build_corpus(
        "embedded", load_tokenizer(get_spec("gemma-tiny").tokenizer), seq_len=32, max_bytes=2**18
    )
    return learner_batches(
        corpus, seed=1, learner=0, num_learners=1, round=0, steps=STEPS, batch_size=4
    )


def _base() -> dict[str, torch.Tensor]:
    model = build_model("gemma-tiny", seed=SEED)
    gen = torch.Generator().manual_seed(3)  # a certified version that is not the init
    return {
        n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in param_state(model).items()
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_batch_that_does_not_split_over_the_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        rank_rows(torch.zeros(2, 4, 8), 0, 3)
    assert rank_rows(torch.arange(8).view(1, 4, 2), 1, 2).tolist() == [[[4, 5], [6, 7]]]


def test_small_collectives_run_on_the_gpu_of_a_nccl_island(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL reduces CUDA tensors only: the finite flag and the stats go on the rank's GPU there,
    and stay on the CPU on gloo (a CPU rank, or a GPU rank of a gloo group)."""
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    assert small_device(torch.device("cuda:1")) == torch.device("cuda:1")
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert small_device(torch.device("cuda:1")) == torch.device("cpu")
    assert small_device(torch.device("cpu")) == torch.device("cpu")


def test_checkpointing_is_enabled_under_either_name_of_transformers() -> None:
    """transformers 5.17 (a GPU image's) has only ``gradient_checkpointing_enable``; 5.2x names
    it ``activation_checkpointing_enable``. Either way each layer is checkpointed, non-reentrant."""
    calls: list[tuple[str, dict]] = []

    class Old(torch.nn.Module):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict) -> None:
            calls.append(("gradient", gradient_checkpointing_kwargs))

    class New(Old):
        def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict) -> None:
            calls.append(("activation", activation_checkpointing_kwargs))

    enable_checkpointing(Old())
    enable_checkpointing(New())
    assert calls == [
        ("gradient", {"use_reentrant": False}),
        ("activation", {"use_reentrant": False}),
    ]


def island_stretch(
    model_name: str,
    seed: int,
    base: Mapping[str, torch.Tensor],
    cfg: InnerConfig,
    batches_TBS: torch.Tensor,
    *,
    global_step: int = 0,
) -> tuple[dict[str, torch.Tensor] | None, InnerStats]:
    """One stretch of inner steps trained by this island with FSDP2, in one call (the one-shot
    form of what ``IslandLearner`` drives through the command channel): train ``batches_TBS``
    (every rank passes the same full batches) from ``base``; return (Δ = base − θ on rank 0,
    None elsewhere) and the island's stats."""
    shards = Shards(model_name, seed, cfg, global_step=global_step)
    shards.scatter(base if dist.get_rank() == 0 else None)
    stats = shards.train(batches_TBS)
    full = shards.gather()
    delta = None if full is None else {n: base[n].float() - t for n, t in full.items()}
    return delta, stats


def _rank_with_a_nan(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1's loss is NaN at its first step: every rank must raise there, none may hang."""
    import p2pdiloco.train.inner as inner

    torch.set_num_threads(1)
    if rank == 1:
        real = inner.lm_loss
        inner.lm_loss = lambda model, rows: real(model, rows) * float("nan")  # type: ignore[assignment]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        island_stretch("gemma-tiny", SEED, _base(), CFG, _batches())
    except FloatingPointError as e:
        Path(out).with_suffix(f".{rank}").write_text(str(e))
    finally:
        dist.barrier()  # both ranks out of the stretch before the group goes
        dist.destroy_process_group()


def test_a_non_finite_loss_on_one_rank_stops_every_rank_at_that_step(tmp_path: Path) -> None:
    out = tmp_path / "nan"
    mp.spawn(_rank_with_a_nan, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    said = [out.with_suffix(f".{r}").read_text() for r in (0, 1)]
    assert all(s.startswith("inner step 0: a loss is not finite on this island") for s in said)
    assert said[1].endswith("(this rank's: nan)") and "nan" not in said[0], said
