"""How many devices of one kind an island needs to train a model with FSDP2 (issue 13 item 3).

Fully sharded, each of N devices holds 1/N of the training state (weights, gradients, AdamW
moments, the DiLoCo base copy and error feedback: ``train.memory``'s per-parameter bytes), its
own activations and logits at its micro-batch (with activation checkpointing, when that is
what makes it fit: one hidden state per layer kept, one layer's activations recomputed at a
time), and the unsharded weights of the unit being
all-gathered plus the next one (prefetch): the largest of one decoder layer or the tied
embedding, at the compute dtype. A 10% allowance covers fragmentation, as in the single-device
estimate. Like that estimate it is for planning and refusing early; the measured per-layer
memory on a GPU is what checks it (``bench/island.py`` when a device is lent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pdiloco.train.memory import ACT_BYTES, OVERHEAD, estimate_memory
from p2pdiloco.train.model_specs import get_spec, parameter_count

MAX_DEVICES = 4096


@dataclass(frozen=True)
class IslandPlan:
    model: str
    precision: str
    devices: int  # N: the FSDP degree
    micro_batch: int  # sequences per device per forward
    checkpointing: bool  # activation checkpointing per decoder layer
    seq_len: int
    shard: int  # bytes of training state per device (1/N of it)
    gathered: int  # bytes of unsharded weights in flight (two units)
    activations: int  # bytes of activations and logits per device
    per_device: int  # everything, with the allowance

    def describe(self) -> str:
        gib = 2**30
        return (
            f"an island of {self.devices} such devices (FSDP2, about "
            f"{self.per_device / gib:.1f} GiB each at micro-batch {self.micro_batch}×{self.seq_len}"
            f"{', activation checkpointing' if self.checkpointing else ''})"
        )


def _unit_params(name: str) -> int:
    spec = get_spec(name)
    embedding = spec.vocab_size * spec.hidden_size
    layer = (parameter_count(name) - embedding - spec.hidden_size) // spec.num_layers
    return max(layer, embedding)


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
    the island would pass ``MAX_DEVICES``."""
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
    spec = get_spec(name)
    gathered = 2 * _unit_params(name) * ACT_BYTES[precision]
    est = estimate_memory(name, precision, micro_batch=b, seq_len=seq_len)
    state = est.weights + est.gradients + est.optimizer + est.diloco_state
    acts = est.activations
    if ckpt:  # a hidden state per layer boundary, one layer's activations at a time
        acts = b * est.seq_len * spec.num_layers * spec.hidden_size * ACT_BYTES[precision]
        acts += est.activations // spec.num_layers
    fixed = (acts + est.logits + gathered) * (1 + OVERHEAD)
    room = device_bytes - fixed
    if room <= 0:
        return None
    n = max(1, math.ceil(state * (1 + OVERHEAD) / room))
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
        gathered=gathered,
        activations=acts + est.logits,
        per_device=int(fixed + state / n * (1 + OVERHEAD)),
    )


def _halvings(b: int) -> list[int]:
    out = [b]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out
