"""What a training island needs in memory, and the refusal when a model does not fit.

The estimate is itemised so that a user can see where the bytes go. Per parameter:

| precision    | weights | grads | AdamW m+v | DiLoCo base copy | error feedback |
|--------------|---------|-------|-----------|------------------|----------------|
| fp32         | 4       | 4     | 8         | 4                | 4              |
| bf16-mixed   | 4       | 4     | 8         | 4                | 4  (fp32 master, bf16 autocast) |
| bf16         | 2       | 2     | 4         | 2                | 2  (pure bf16, for the largest) |

Activations are counted per layer per token for a gated-MLP decoder with a fused attention
kernel (no S×S score matrix kept): residual + 2 norms in/out ≈ 7h, q/k/v/attn-out ≈ 3q + 2kv,
MLP gate/up/act/product ≈ 4i, at the activation dtype; plus fp32 logits and their gradient over
the vocabulary, which dominate for Gemma's 262k vocabulary at small batch. A 10% allowance
covers allocator fragmentation and framework workspace. It is an estimate for refusing early,
not a guarantee: the real peak is measured by ``bench/`` on the device.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from p2pdiloco.errors import UserError
from p2pdiloco.train.model_specs import ModelSpec, get_spec, model_names, parameter_count

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
GiB = 2**30

_PER_PARAM = {  # weights, grads, optimizer, base copy, error feedback
    "fp32": (4, 4, 8, 4, 4),
    "bf16-mixed": (4, 4, 8, 4, 4),
    "bf16": (2, 2, 4, 2, 2),
}
ACT_BYTES = {"fp32": 4, "bf16-mixed": 2, "bf16": 2}
OVERHEAD = 0.10


class ModelTooLarge(UserError):
    """Raised before any allocation when the model cannot train on the chosen device."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a learner needs to train one model at one batch, by component."""

    model: str
    precision: str
    micro_batch: int
    seq_len: int
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    diloco_state: int
    activations: int
    logits: int
    overhead: int
    total: int

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


def estimate_memory(
    name: str, precision: str = "fp32", micro_batch: int | None = None, seq_len: int | None = None
) -> MemoryEstimate:
    """Itemised training-memory estimate; raise ValueError for an unknown precision."""
    if precision not in _PER_PARAM:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not '{precision}'")
    spec = get_spec(name)
    b = micro_batch if micro_batch is not None else spec.train_micro_batch
    s = seq_len if seq_len is not None else spec.train_seq_len
    p = parameter_count(name)
    w, g, opt, base, ef = (p * k for k in _PER_PARAM[precision])
    acts = _activation_bytes(spec, b, s, ACT_BYTES[precision])
    logits = b * s * spec.vocab_size * 4 * 2  # fp32 logits + their gradient
    subtotal = w + g + opt + base + ef + acts + logits
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
        diloco_state=base + ef,
        activations=acts,
        logits=logits,
        overhead=overhead,
        total=subtotal + overhead,
    )


def _activation_bytes(spec: ModelSpec, micro_batch: int, seq_len: int, act_bytes: int) -> int:
    h, i = spec.hidden_size, spec.intermediate_size
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    per_token_layer = 7 * h + 3 * q + 2 * kv + 4 * i
    return micro_batch * seq_len * spec.num_layers * per_token_layer * act_bytes


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
    copies with their own optimizer state held at once (the simulator keeps one per learner);
    activations are counted once, as replicas train one after the other.
    """
    est = estimate_memory(name, precision, micro_batch, seq_len)
    per_replica = est.weights + est.gradients + est.optimizer + est.diloco_state
    needed = est.total + int((replicas - 1) * per_replica * (1 + OVERHEAD))
    if available is None:
        have, where = available_memory(device)
    else:
        have, where = available, f"{device.type} ({available / GiB:.1f} GiB allowed)"
    if needed <= have:
        return est
    fitting = [
        n for n in model_names() if estimate_memory(n, precision).total <= have and n != name
    ]
    hint = f"; {fitting[-1]} would fit" if fitting else "; no registered model fits this device"
    raise ModelTooLarge(
        f"{name} needs about {needed / GiB:.1f} GiB to train in {precision} "
        f"(batch {est.micro_batch}×{est.seq_len}"
        f"{f', {replicas} replicas' if replicas > 1 else ''}), but {where}{hint}"
    )
