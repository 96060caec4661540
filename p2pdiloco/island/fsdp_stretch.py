"""One stretch of inner steps trained by an island of processes with FSDP2 (``fully_shard``).

Every rank builds the run's model from the seed, loads the certified parameters, shards each
decoder layer and then the root (embeddings, final norm, the tied head), and trains on its own
contiguous block of rows of every step's batch: FSDP2 averages the gradients across ranks, so
a step is the step one process would take on the whole batch. The island's delta is gathered
tensor by tensor (``DTensor.full_tensor``, a collective every rank joins in the same order)
and kept on rank 0 only, which speaks for the island: the other ranks hold one unsharded tensor
at a time beside their shards and the base, rank 0 the delta it builds.

Runs on any torch.distributed backend: gloo on CPU (tests), NCCL on GPUs. The process group
is the caller's (``torch.distributed.init_process_group``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from p2pdiloco.train.configs import InnerConfig
from p2pdiloco.train.inner import InnerStats, make_inner_optimizer, seek_schedule, train_steps
from p2pdiloco.train.models import build_model, named_trainable


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root (what is left: embeddings, norms)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer)
    fully_shard(model)
    return model


def rank_rows(batches_TBS: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous block of every step's rows; ValueError unless B divides evenly
    (unequal blocks would weigh the ranks' rows unequally in the averaged gradient)."""
    batch = batches_TBS.shape[1]
    if batch % world:
        raise ValueError(f"a step batch of {batch} rows does not split over {world} ranks")
    per = batch // world
    return batches_TBS[:, rank * per : (rank + 1) * per]


def _all_ranks(finite: bool) -> bool:
    """True only if every rank's loss is finite (one all-reduce of a flag per step)."""
    flag = torch.tensor([1 if finite else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def island_stretch(
    model_name: str,
    seed: int,
    base: Mapping[str, torch.Tensor],
    cfg: InnerConfig,
    batches_TBS: torch.Tensor,
    *,
    global_step: int = 0,
) -> tuple[dict[str, torch.Tensor] | None, InnerStats]:
    """Train ``batches_TBS`` (every rank passes the same full batches) from ``base`` on this
    island; return (Δ = base − θ on rank 0, None elsewhere) and this rank's stats."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(model_name, seed=seed)
    with torch.no_grad():
        for n, p in named_trainable(model):
            p.copy_(base[n])
    shard_model(model)
    optimizer, scheduler = make_inner_optimizer(model, cfg)
    seek_schedule(optimizer, scheduler, global_step)
    stats = train_steps(
        model,
        optimizer,
        scheduler,
        rank_rows(batches_TBS, rank, world),
        grad_accum=cfg.grad_accum,
        grad_clip=cfg.grad_clip,
        all_finite=_all_ranks,
    )
    delta: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    for n, p in named_trainable(model):
        full = p.detach().full_tensor()  # type: ignore[attr-defined]
        if delta is not None:
            delta[n] = base[n].float() - full.float()
    return delta, stats
