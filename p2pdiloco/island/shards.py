"""One rank's part of an island: the FSDP2-sharded model, its inner optimizer and schedule.

Every rank of an island builds the run's model from the seed, shards each decoder layer and
then the root (embeddings, final norm, the tied head) with ``fully_shard``, and keeps AdamW
moments for its shards only. The island's ranks then do everything together, in the same
order, since each operation is a collective:

- ``scatter``: rank 0's full parameters become every rank's shards (a version to train from);
- ``train``: each rank trains on its own contiguous block of every step's rows; FSDP2 averages
  the gradients, so a step is the step one process would take on the whole batch;
- ``gather``: the full parameters, tensor by tensor, kept on rank 0 only (which speaks for the
  island): no rank ever holds more than one unsharded tensor beside its shards.

Runs on any torch.distributed backend: gloo on CPU (tests), NCCL on GPUs. The process group is
the caller's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from p2pdiloco.train.configs import InnerConfig
from p2pdiloco.train.inner import InnerStats, make_inner_optimizer, seek_schedule, train_steps
from p2pdiloco.train.models import build_for_loading, named_trainable


def shard_model(
    model: torch.nn.Module, *, checkpointing: bool = False, offload: bool = False
) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root (what is left: embeddings, norms).
    ``checkpointing``: recompute each layer's activations in the backward pass (the island
    plan's choice when they would not fit); ``offload``: keep parameters, gradients and the
    optimizer's moments in host memory (CUDA only), streamed to the device layer by layer."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if checkpointing:
        enable_checkpointing(model)
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant): the
    name of transformers 5.2x, or before it ``gradient_checkpointing_enable`` (5.17 has only
    that one)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]


def rank_rows(batches_TBS: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous block of every step's rows; ValueError unless B divides evenly
    (unequal blocks would weigh the ranks' rows unequally in the averaged gradient)."""
    batch = batches_TBS.shape[1]
    if batch % world:
        raise ValueError(f"a step batch of {batch} rows does not split over {world} ranks")
    per = batch // world
    return batches_TBS[:, rank * per : (rank + 1) * per]


def small_device(device: torch.device) -> torch.device:
    """Where the island's small collectives (the finite flag, the stats) run: NCCL reduces
    CUDA tensors only, so on a NCCL island this rank's GPU; the CPU on gloo."""
    if device.type == "cuda" and dist.get_backend() == "nccl":
        return device
    return torch.device("cpu")


def _all_ranks(finite: bool, device: torch.device | None = None) -> bool:
    """True only if every rank's loss is finite (one all-reduce of a flag per step)."""
    flag = torch.tensor([1 if finite else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class Shards:
    """This rank's shards of the island's model, optimizer and learning-rate schedule."""

    def __init__(
        self,
        model_name: str,
        seed: int,
        cfg: InnerConfig,
        *,
        global_step: int = 0,
        device: torch.device | None = None,
        micro_batch: int | None = None,
        checkpointing: bool = False,
        offload: bool = False,
    ) -> None:
        """``micro_batch``: sequences per forward pass on this rank (None: all its rows);
        ``checkpointing``, ``offload``: see ``shard_model``."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device or torch.device("cpu")
        rows = cfg.batch_size // self.world if cfg.batch_size % self.world == 0 else 0
        if rows == 0:
            raise ValueError(
                f"the run's step batch of {cfg.batch_size} rows does not split over "
                f"{self.world} island ranks"
            )
        if micro_batch is not None and rows % micro_batch == 0:
            cfg = replace(cfg, grad_accum=rows // micro_batch)
        elif cfg.grad_accum > 1 and rows % cfg.grad_accum:
            cfg = replace(cfg, grad_accum=1)
        self.cfg = cfg
        self.small = small_device(self.device)
        if offload and self.device.type != "cuda":
            raise ValueError("optimizer offload moves state off a GPU: it needs CUDA ranks")
        # Parameters on the meta device until sharded: a rank allocates its shards only, never
        # the whole model (scattered into next: ``scatter``).
        model = build_for_loading(model_name, device=self.device, params_on_meta=True)
        buffers = dict(model.named_buffers())
        self.model = shard_model(model, checkpointing=checkpointing, offload=offload)
        self.model.to_empty(device=torch.device("cpu") if offload else self.device)
        for name, value in buffers.items():  # to_empty left them uninitialised
            owner, _, leaf = name.rpartition(".")
            self.model.get_submodule(owner)._buffers[leaf] = value
        self.optimizer, self.scheduler = make_inner_optimizer(self.model, cfg)
        seek_schedule(self.optimizer, self.scheduler, global_step)

    def seek(self, global_step: int) -> None:
        seek_schedule(self.optimizer, self.scheduler, global_step)

    @torch.no_grad()
    def scatter(self, full: Mapping[str, torch.Tensor] | None) -> None:
        """Load rank 0's ``full`` parameters (None on the other ranks) into every rank's shards."""
        from torch.distributed.tensor import distribute_tensor

        for n, p in named_trainable(self.model):
            local = p.to_local()  # type: ignore[attr-defined]
            if full is not None:
                src = full[n].to(self.device, p.dtype)
            else:
                src = torch.empty(p.shape, dtype=p.dtype, device=self.device)
            part = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=0)  # type: ignore[attr-defined]
            local.copy_(part.to_local())

    @torch.no_grad()
    def gather(self) -> dict[str, torch.Tensor] | None:
        """The full parameters (fp32, CPU) on rank 0; None on the other ranks."""
        out: dict[str, torch.Tensor] | None = {} if self.rank == 0 else None
        for n, p in named_trainable(self.model):
            full = p.detach().full_tensor()  # type: ignore[attr-defined]
            if out is not None:
                out[n] = full.float().cpu()
            del full
        return out

    def train(self, batches_TBS: torch.Tensor) -> InnerStats:
        """Train the island's step batches (every rank passes the same full batches); the stats
        are the island's: tokens summed over the ranks, losses averaged."""
        mine = train_steps(
            self.model,
            self.optimizer,
            self.scheduler,
            rank_rows(batches_TBS, self.rank, self.world),
            grad_accum=self.cfg.grad_accum,
            grad_clip=self.cfg.grad_clip,
            all_finite=partial(_all_ranks, device=self.small),
        )
        sums = torch.tensor(
            [mine.tokens, mine.loss_mean, mine.loss_last], dtype=torch.float64, device=self.small
        )
        dist.all_reduce(sums)
        sums = sums.cpu()
        return InnerStats(
            steps=mine.steps,
            tokens=int(sums[0].item()),
            loss_mean=float(sums[1]) / self.world,
            loss_last=float(sums[2]) / self.world,
            seconds=mine.seconds,
        )
