"""The inner loop: AdamW with warmup + cosine, gradient accumulation and clipping.

Shapes: T inner steps, B sequences per step, S = seq_len + 1 tokens per packed row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from contextlib import closing
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from p2pdiloco.train.configs import InnerConfig
from p2pdiloco.train.device import autocast_for, synchronize


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at ``step``: linear warmup, then cosine down to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_inner_optimizer(
    model: torch.nn.Module, cfg: InnerConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model (decay on ≥2-D tensors only) and its warmup+cosine schedule."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        foreach=True,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio)
    )
    return opt, sched


def seek_schedule(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, step: int
) -> None:
    """Put the warmup+cosine schedule, and every group's lr, at global inner step ``step``."""
    scheduler.last_epoch = step
    for group, base_lr, fn in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base_lr * fn(step)


def lm_loss(model: torch.nn.Module, rows_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a batch of packed rows (fp32 loss)."""
    inputs_BL, targets_BL = rows_BS[:, :-1], rows_BS[:, 1:]
    logits_BLV = model(input_ids=inputs_BL, use_cache=False).logits
    return F.cross_entropy(logits_BLV.float().flatten(0, 1), targets_BL.flatten())


@dataclass
class InnerStats:
    """What one stretch of inner steps did."""

    steps: int
    tokens: int
    loss_mean: float
    loss_last: float
    seconds: float


def train_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batches_TBS: torch.Tensor,
    *,
    grad_accum: int = 1,
    grad_clip: float = 1.0,
    all_finite: Callable[[bool], bool] | None = None,
    on_step: Callable[[int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> InnerStats:
    """Run one inner step per leading slice of ``batches_TBS`` on the model's device;
    ``on_step(done)`` after each (what a dashboard shows between chunks). Once ``stop()`` is
    true after a step, the rest are left (a node stopping); the stats count the steps done.

    Raises ValueError if B is not divisible by ``grad_accum``; a non-finite loss raises
    FloatingPointError before the optimizer touches the weights, so a diverged learner never
    produces a delta from corrupted parameters. ``all_finite`` (an island's ranks) turns this
    rank's verdict into everyone's, so all ranks raise at the same step and none is left
    waiting in a collective for one that stopped.
    """
    device = next(model.parameters()).device
    steps, batch, seq = batches_TBS.shape
    if batch % grad_accum:
        raise ValueError(f"batch size {batch} is not divisible by grad_accum {grad_accum}")
    model.train()
    t0 = time.perf_counter()
    losses = torch.zeros(steps, dtype=torch.float64)
    done = steps
    for t in range(steps):
        step_rows_BS = batches_TBS[t].to(device, non_blocking=True)
        step_loss = torch.zeros((), device=device)
        for micro_bS in step_rows_BS.chunk(grad_accum):
            with autocast_for(device):
                loss = lm_loss(model, micro_bS) / grad_accum
            loss.backward()
            step_loss += loss.detach()
        finite = bool(torch.isfinite(step_loss))
        if all_finite is not None:
            finite = all_finite(finite)
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            if all_finite is None:
                raise FloatingPointError(f"inner step {t}: loss is {step_loss.item()}")
            raise FloatingPointError(
                f"inner step {t}: a loss is not finite on this island (this rank's: "
                f"{step_loss.item()})"
            )
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses[t] = step_loss.item()
        if on_step is not None:
            on_step(t + 1)
        if stop is not None and t + 1 < steps and stop():
            done = t + 1
            losses = losses[:done]
            break
    synchronize(device)
    return InnerStats(
        steps=done,
        tokens=done * batch * (seq - 1),
        loss_mean=float(losses.mean()),
        loss_last=float(losses[-1]),
        seconds=time.perf_counter() - t0,
    )


def _eval_batches(
    model: torch.nn.Module, batches: list[torch.Tensor], check: Callable[[], None] | None
) -> Generator[torch.Tensor]:
    """``batches`` on the model's device, the model in eval mode meanwhile (its mode restored
    when the generator ends or is closed: callers hold it in ``closing``, so also when their
    loop raises); ``check()`` before each may raise to stop."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for rows_BS in batches:
            if check is not None:
                check()
            yield rows_BS.to(device)
    finally:
        model.train(was_training)


@torch.no_grad()
def row_losses(
    model: torch.nn.Module,
    batches: list[torch.Tensor],
    check: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Mean next-token loss of every row of ``batches`` ([B, S] each), float64 [N] on the CPU,
    in eval mode (restored after): what a work score's per-row test reads (ADR 0070).
    ``check()`` runs before each batch and may raise to stop (a node stopping)."""
    out = []
    with closing(_eval_batches(model, batches, check)) as on_device:
        for rows_BS in on_device:
            with autocast_for(rows_BS.device):
                logits_BLV = model(input_ids=rows_BS[:, :-1], use_cache=False).logits
            loss_BL = F.cross_entropy(
                logits_BLV.float().transpose(1, 2), rows_BS[:, 1:], reduction="none"
            )
            out.append(loss_BL.mean(1).double().cpu())
    if not out:
        raise ValueError("row_losses() needs at least one batch")
    return torch.cat(out)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[torch.Tensor],
    check: Callable[[], None] | None = None,
) -> float:
    """Token-weighted mean eval loss over ``batches`` of [B, S] rows; restores train mode.
    ``check()`` runs before each batch and may raise to stop (a node stopping)."""
    total, count = 0.0, 0
    with closing(_eval_batches(model, batches, check)) as on_device:
        for rows_BS in on_device:
            with autocast_for(rows_BS.device):
                loss = lm_loss(model, rows_BS)
            n = rows_BS.shape[0] * (rows_BS.shape[1] - 1)
            total += loss.item() * n
            count += n
    if count == 0:
        raise ValueError("evaluate() needs at least one eval batch")
    return total / count
