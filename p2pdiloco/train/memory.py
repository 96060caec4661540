"""What one learner needs in memory on one device, and the refusal when a model does not fit.

The estimate is itemised so that a user can see where the bytes go. Per parameter:

| precision    | weights | grads | AdamW m+v | DiLoCo base copy | error feedback |
|--------------|---------|-------|-----------|------------------|----------------|
| fp32         | 4       | 4     | 8         | 4                | 4              |
| bf16-mixed   | 4       | 4     | 8         | 4                | 4  (fp32 master, bf16 autocast) |
| bf16         | 2       | 2     | 4         | 2                | 2  (pure bf16, for the largest) |

A learner keeps its DiLoCo state in host memory: it counts on the CPU and Apple's unified
memory, not on a CUDA or XLA device (``shares_host_memory``). Beside the state, the step's peak
is what the island plan counts for one device (``step_memory``, ADR 0049), with nothing
gathered: autocast's bf16 weight copies, the activations of every layer, the logits (10–12 B
per token per vocabulary entry, which dominate at Gemma's 262k vocabulary), and ``RESIDENT``.
On one H200 that lands at or above gemma-1b's and gemma-4b's measured peaks
(``tests/test_memory.py``); ``OVERHEAD`` covers the caching allocator's reserve above the peak.
It is an estimate for refusing early, not a guarantee: the real peak is measured by ``bench/``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from p2pdiloco.errors import UserError
from p2pdiloco.train.model_specs import get_spec, model_names, parameter_count
from p2pdiloco.train.step_memory import RESIDENT, step_peak

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
GiB = 2**30

_PER_PARAM = {  # weights, grads, optimizer, base copy, error feedback
    "fp32": (4, 4, 8, 4, 4),
    "bf16-mixed": (4, 4, 8, 4, 4),
    "bf16": (2, 2, 4, 2, 2),
}
# The caching allocator's reserve above the peak on one GPU without FSDP2 measured 1.5 %
# (gemma-1b) and 3.8 % (gemma-4b); the island's FSDP2 path took 9–11 % at the same shapes and
# up to 25 % with 12B-wide layers, which its own allowance covers (``island_plan.ALLOWANCE``).
OVERHEAD = 0.10


class ModelTooLarge(UserError):
    """Raised before any allocation when the model cannot train on the chosen device."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a learner needs on its device to train one model at one batch, by component."""

    model: str
    precision: str
    micro_batch: int
    seq_len: int
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    diloco_state: int  # base copy and error feedback, where they share the device's memory
    phase: str  # the step's phase at the peak (``step_memory.StepPeak``)
    casts: int  # autocast's bf16 weight copies at the peak
    in_flight: int  # gradients not yet accumulated at the peak (the tied head's, a layer's)
    activations: int
    logits: int
    resident: int  # buffers and library workspaces (``step_memory.RESIDENT``)
    overhead: int
    total: int

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


def shares_host_memory(device: torch.device) -> bool:
    """Whether ``device`` trains in the host's memory, where the learner keeps its DiLoCo state
    (the CPU, Apple's unified memory); CUDA and XLA devices have their own."""
    return device.type not in ("cuda", "xla")


def estimate_memory(
    name: str,
    precision: str = "fp32",
    micro_batch: int | None = None,
    seq_len: int | None = None,
    *,
    state_on_device: bool = True,
) -> MemoryEstimate:
    """Itemised estimate for the whole model on one device (no FSDP2, no checkpointing);
    raise ValueError for an unknown precision. ``state_on_device``: count the DiLoCo state in
    the device's memory (``shares_host_memory``; the simulator keeps it there too)."""
    if precision not in _PER_PARAM:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not '{precision}'")
    spec = get_spec(name)
    b = micro_batch if micro_batch is not None else spec.train_micro_batch
    s = seq_len if seq_len is not None else spec.train_seq_len
    p = parameter_count(name)
    w, g, opt, base, ef = (p * k for k in _PER_PARAM[precision])
    diloco = base + ef if state_on_device else 0
    peak = step_peak(name, precision, b, s, ckpt=False, fsdp=False)
    subtotal = w + g + opt + diloco + peak.total + RESIDENT
    overhead = int(subtotal * OVERHEAD)
    return MemoryEstimate(
        model=name,
        precision=precision,
        micro_batch=b,
        seq_len=s,
        parameters=p,
        weights=w,
        gradients=g,
        optimizer=opt,
        diloco_state=diloco,
        phase=peak.phase,
        casts=peak.casts,
        in_flight=peak.unsharded,
        activations=peak.activations,
        logits=peak.logits,
        resident=RESIDENT,
        overhead=overhead,
        total=subtotal + overhead,
    )


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes free for training on ``device``, a human description of where that came from)."""
    import torch  # only here: the estimate itself needs no torch

    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
        return free, f"{name} ({total / GiB:.1f} GiB, {free / GiB:.1f} GiB free)"
    if device.type == "mps":
        limit = int(torch.mps.recommended_max_memory())
        return limit, f"Apple GPU ({limit / GiB:.1f} GiB usable)"
    avail = _host_available()
    return avail, f"CPU host memory ({avail / GiB:.1f} GiB available)"


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(
    name: str,
    device: torch.device,
    precision: str = "fp32",
    micro_batch: int | None = None,
    seq_len: int | None = None,
    available: int | None = None,
    replicas: int = 1,
) -> MemoryEstimate:
    """Return the estimate if ``name`` fits ``device``; else raise ModelTooLarge.

    The message names what the model needs, what the device has, and the largest registered
    model that would fit (at its own default batch), so a volunteer can act on it at once.
    ``available`` overrides the probe (tests, ``--max-memory``). ``replicas`` counts model
    copies with their own optimizer and DiLoCo state held at once on the device (the simulator
    keeps one per learner); activations are counted once, as replicas train one after the other.
    """
    on_device = replicas > 1 or shares_host_memory(device)
    est = estimate_memory(name, precision, micro_batch, seq_len, state_on_device=on_device)
    per_replica = est.weights + est.gradients + est.optimizer + est.diloco_state
    needed = est.total + int((replicas - 1) * per_replica * (1 + OVERHEAD))
    if available is None:
        have, where = available_memory(device)
    else:
        have, where = available, f"{device.type} ({available / GiB:.1f} GiB allowed)"
    if needed <= have:
        return est
    fitting = [
        n
        for n in model_names()
        if n != name and estimate_memory(n, precision, state_on_device=on_device).total <= have
    ]
    hint = f"; {fitting[-1]} would fit" if fitting else "; no registered model fits this device"
    raise ModelTooLarge(
        f"{name} needs about {needed / GiB:.1f} GiB to train in {precision} "
        f"(batch {est.micro_batch}×{est.seq_len}"
        f"{f', {replicas} replicas' if replicas > 1 else ''}), but {where}{hint}"
    )
