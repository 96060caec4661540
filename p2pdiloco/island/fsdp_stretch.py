"""One stretch of inner steps trained by an island of processes with FSDP2, in one call.

The building block under ``IslandLearner`` (which keeps ``Shards`` across stretches and is
driven by rank 0 through the island's command channel); this one-shot form is what the test
that compares an island's delta with one process's calls on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from p2pdiloco.island.shards import Shards
from p2pdiloco.train.configs import InnerConfig
from p2pdiloco.train.inner import InnerStats


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
    island; return (Δ = base − θ on rank 0, None elsewhere) and the island's stats."""
    shards = Shards(model_name, seed, cfg, global_step=global_step)
    shards.scatter(base if dist.get_rank() == 0 else None)
    stats = shards.train(batches_TBS)
    full = shards.gather()
    delta = None if full is None else {n: base[n].float() - t for n, t in full.items()}
    return delta, stats
