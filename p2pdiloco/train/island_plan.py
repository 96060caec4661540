"""How many devices of one kind an island needs to train a model with FSDP2 (issue 13 item 3).

The memory model follows what one H200 measured per decoder layer of gemma-12b's real width
(ADR 0049; ``bench/gpu_island.py``, docs/data/gpu_island_h200.json). Per device, with P
parameters and N devices:

- **sharded over N**: fp32 weights, gradients and AdamW moments, 16 B per parameter (8 in pure
  bf16), the only state FSDP2 splits;
- **not sharded** (``step_memory``, shared with the one-device estimate): autocast's bf16 copy
  of every weight, 2 B per parameter of the whole model; the activations and logits of one
  micro-batch; the units FSDP2 gathers and the gradients it has not yet reduced; the largest of
  the step's three phases.

At one rank this lands 0.1–4.0 % above every measured peak (gemma-1b, gemma-4b, gemma-12b at 2,
6 and 10 layers; gemma-4b checkpointed at 1 × 4096, measured after, 0.7 %) and within 0.4 % of
the per-layer slopes (16 + 2 B per parameter plus the activations). With autocast's cache off
the checkpointed 12B layer measured 3.41 GiB, not 3.82: the 2 B per parameter are those copies
(``bench/gpu_island_nocache.py``). ``ALLOWANCE`` covers the caching allocator's reserve above
the peak and what several ranks add. It is for planning and refusing early; a device's measured
peak is what checks it (``bench/gpu_island.py``).

Not on any device: the DiLoCo state lives on rank 0's host (``HOST_BYTES_PER_PARAM``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pdiloco.train.memory import estimate_memory
from p2pdiloco.train.model_specs import get_spec, parameter_count
from p2pdiloco.train.step_memory import step_peak

MAX_DEVICES = 4096
# The caching allocator's reserve above the peak, up to 25 % measured (12B-wide layers on the
# H200), and 5 % for what an island of several ranks adds that one rank did not measure: NCCL's
# communicators and buffers, FSDP2's staging copies for its collectives.
ALLOWANCE = 0.30
# Rank 0's host memory per parameter, counted from the code (fp32 whatever the precision), not
# measured: the current and previous certified versions (parameters and outer momentum, 8 B,
# and their encoded chunks served to peers, 8 B: 32 for two), the error-feedback residual (4),
# θ_sent while a delta is in flight (4), and in a rebase the gathered parameters and their
# rebased copy (8). A committee member's merge adds its inputs beside this.
HOST_BYTES_PER_PARAM = 48


@dataclass(frozen=True)
class IslandPlan:
    model: str
    precision: str
    devices: int  # N: the FSDP degree
    micro_batch: int  # sequences per device per forward
    checkpointing: bool  # activation checkpointing per decoder layer
    seq_len: int
    shard: int  # bytes of training state per device (1/N of it)
    casts: int  # bytes of autocast's bf16 weight copies at the peak (not sharded)
    gathered: int  # bytes of FSDP2's unsharded units and unreduced gradients at the peak
    activations: int  # bytes of activations and logits per device at the peak
    per_device: int  # everything, with the allowance
    host: int  # bytes on rank 0's host: the DiLoCo state (counted, not measured)

    def describe(self) -> str:
        gib = 2**30
        return (
            f"an island of {self.devices} such devices (FSDP2, about "
            f"{self.per_device / gib:.1f} GiB each at micro-batch {self.micro_batch}×{self.seq_len}"
            f"{', activation checkpointing' if self.checkpointing else ''}; "
            f"rank 0's host about {self.host / gib:.0f} GiB)"
        )


def rank0_host_bytes(name: str) -> int:
    """Bytes rank 0's host keeps for an island of ``name`` (``HOST_BYTES_PER_PARAM``)."""
    return HOST_BYTES_PER_PARAM * parameter_count(name)


def peak_terms(name: str, precision: str, b: int, s: int, ckpt: bool) -> tuple[int, int, int]:
    """(casts, gathered, activations and logits) in bytes at the step's peak on one device of
    an island, whatever N: the phase of the three whose sum is largest (``step_peak``)."""
    peak = step_peak(name, precision, b, s, ckpt, fsdp=True)
    return peak.casts, peak.unsharded, peak.activations + peak.logits


def plan_island(
    name: str,
    precision: str,
    device_bytes: int,
    micro_batch: int | None = None,
    seq_len: int | None = None,
) -> IslandPlan | None:
    """The smallest island of devices with ``device_bytes`` each that trains ``name``: the
    fewest devices over the micro-batches tried (the given one, or the model's default halved
    down to 1) with and without activation checkpointing; on a tie, the larger micro-batch, then
    no checkpointing. None if no micro-batch fits one device beside its share of the state, or
    the island would pass ``MAX_DEVICES``. Rank 0's host memory (``IslandPlan.host``) is not
    part of ``device_bytes``: check it against the host's own."""
    first = micro_batch if micro_batch is not None else get_spec(name).train_micro_batch
    batches = [first] if micro_batch is not None else _halvings(first)
    plans = [
        plan
        for b in batches
        for ckpt in (False, True)
        if (plan := _plan(name, precision, device_bytes, b, seq_len, ckpt)) is not None
    ]
    if not plans:
        return None
    return min(plans, key=lambda p: (p.devices, -p.micro_batch, p.checkpointing))


def _plan(
    name: str, precision: str, device_bytes: int, b: int, seq_len: int | None, ckpt: bool
) -> IslandPlan | None:
    est = estimate_memory(name, precision, micro_batch=b, seq_len=seq_len)
    state = est.weights + est.gradients + est.optimizer  # the DiLoCo state is on the host
    casts, gathered, acts = peak_terms(name, precision, b, est.seq_len, ckpt)
    fixed = (casts + gathered + acts) * (1 + ALLOWANCE)
    room = device_bytes - fixed
    if room <= 0:
        return None
    n = max(1, math.ceil(state * (1 + ALLOWANCE) / room))
    if n > MAX_DEVICES:
        return None
    return IslandPlan(
        model=name,
        precision=precision,
        devices=n,
        micro_batch=b,
        checkpointing=ckpt,
        seq_len=est.seq_len,
        shard=state // n,
        casts=casts,
        gathered=gathered,
        activations=acts,
        per_device=int(fixed + state / n * (1 + ALLOWANCE)),
        host=rank0_host_bytes(name),
    )


def _halvings(b: int) -> list[int]:
    out = [b]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out
