"""How many devices of one kind an island needs to train a model with FSDP2 (issue 13 item 3).

The memory model follows what one H200 measured per decoder layer of gemma-12b's real width
(ADR 0049; ``bench/gpu_island.py``, docs/data/gpu_island_h200.json). Per device, at the peak
of an inner step, with P parameters, L decoder layers of P_L each, the embedding of E = V × h
tied to the head, T = micro-batch × sequence tokens and N devices:

- **sharded over N**: fp32 weights, gradients and AdamW moments, 16 B per parameter (8 in pure
  bf16), the only state FSDP2 splits;
- **not sharded, under bf16 autocast**: the bf16 copy of every weight a matmul used, 2 B per
  parameter of the whole model. Autocast caches each cast until the forward leaves its context,
  and without checkpointing autograd keeps them for the backward, so FSDP2 resharding a layer
  after its forward frees the fp32 weights but not their bf16 copies;
- **activations** (``layer_activation_bytes``): without checkpointing what every layer keeps
  for its backward; with it each layer's input (the residual stream), and in the backward one
  layer's recomputed set at a time;
- **logits**: 10 B per token per vocabulary entry at the forward's end (bf16 logits, their fp32
  copy, the log-softmax), 12 B in the loss's backward (the log-softmax and two gradients);
- **gathered by FSDP2**, at the parameters' dtype (no mixed-precision policy: fp32): the root
  (the embedding) unsharded for the whole step, one decoder layer and the one prefetched; in the
  backward also the root's unsharded gradient and a layer's.

The peak is the largest of three phases (the forward's end, the loss's backward, the layers'
backward), which hold different terms. At one rank this lands 0.1–4.0 % above every measured
peak (gemma-1b, gemma-4b, gemma-12b at 2, 6 and 10 layers; gemma-4b checkpointed at 1 × 4096,
measured after, 0.7 %) and within 0.4 % of the per-layer slopes (16 + 2 B per parameter plus the
activations). With autocast's cache off the checkpointed 12B layer measured 3.41 GiB, not 3.82:
the 2 B per parameter are those copies (``bench/gpu_island_nocache.py``). ``ALLOWANCE`` covers
the caching allocator's reserve above the peak and what several ranks add. It is for planning
and refusing early; a device's measured peak is what checks it (``bench/gpu_island.py``).

Not on any device: the DiLoCo state lives on rank 0's host (``HOST_BYTES_PER_PARAM``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pdiloco.train.memory import ACT_BYTES, estimate_memory
from p2pdiloco.train.model_specs import ModelSpec, get_spec, parameter_count

MAX_DEVICES = 4096
# The caching allocator's reserve above the peak, up to 25 % measured (12B-wide layers on the
# H200), and 5 % for what an island of several ranks adds that one rank did not measure: NCCL's
# communicators and buffers, FSDP2's staging copies for its collectives.
ALLOWANCE = 0.30
LOGITS_FWD, LOGITS_BWD = 10, 12  # bytes per token per vocabulary entry, see the docstring
# Rank 0's host memory per parameter, counted from the code (fp32 whatever the precision), not
# measured: the current and previous certified versions (parameters and outer momentum, 8 B,
# and their encoded chunks served to peers, 8 B: 32 for two), the error-feedback residual (4),
# θ_sent while a delta is in flight (4), and in a rebase the gathered parameters and their
# rebased copy (8). A committee member's merge adds its inputs beside this.
HOST_BYTES_PER_PARAM = 48
_PARAM_BYTES = {"fp32": 4, "bf16-mixed": 4, "bf16": 2}  # a parameter (and its gradient)
_RESIDUAL_BYTES = {"fp32": 4, "bf16-mixed": 4, "bf16": 2}  # the residual stream's dtype


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
    gathered: int  # bytes of unsharded FSDP2 units at the peak
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


def layer_activation_bytes(spec: ModelSpec, precision: str) -> int:
    """Bytes one Gemma 3 decoder layer keeps for its backward, per token, without checkpointing.

    Counted from the layer as transformers runs it: four RMSNorms computing in fp32, each
    keeping its fp32 input and normalised value (8h each); the projections' inputs (under
    autocast each of q, k, v, gate and up casts its own bf16 copy, otherwise the two norms'
    outputs are shared); the q and k norms in fp32 (8 B per q and kv width); attention's q, k
    and v repeated to every head and its output (4 × q at the activation dtype) and the output
    projection's input; the MLP's gate, up, their activation and product. For bf16 autocast
    with the fp32 residual stream that is 42h + 18q + 8kv + 8i bytes; with gemma-12b's layer
    at 4096 tokens it gives 1.43 GiB, and with the bf16 weight copies 5.18 GiB per layer
    against 5.17 measured (2048 × 2 tokens).
    """
    h, i = spec.hidden_size, spec.intermediate_size
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    a = ACT_BYTES[precision]
    norms = 4 * 8 * h
    inputs = 5 * a * h if precision == "bf16-mixed" else 2 * _RESIDUAL_BYTES[precision] * h
    attention = 8 * q + 8 * kv + 4 * a * q + a * q
    mlp = 4 * a * i
    return norms + inputs + attention + mlp


def rank0_host_bytes(name: str) -> int:
    """Bytes rank 0's host keeps for an island of ``name`` (``HOST_BYTES_PER_PARAM``)."""
    return HOST_BYTES_PER_PARAM * parameter_count(name)


def _parts(name: str) -> tuple[ModelSpec, int, int]:
    """(spec, embedding parameters, parameters of one decoder layer)."""
    spec = get_spec(name)
    embedding = spec.vocab_size * spec.hidden_size
    layer = (parameter_count(name) - embedding - spec.hidden_size) // spec.num_layers
    return spec, embedding, layer


def peak_terms(name: str, precision: str, b: int, s: int, ckpt: bool) -> tuple[int, int, int]:
    """(casts, gathered, activations) in bytes at the step's peak on one device, whatever N:
    the phase of the three whose sum is largest."""
    spec, emb, layer = _parts(name)
    h, vocab, layers = spec.hidden_size, spec.vocab_size, spec.num_layers
    tokens = b * s
    autocast = precision == "bf16-mixed"
    w, r, a = _PARAM_BYTES[precision], _RESIDUAL_BYTES[precision], ACT_BYTES[precision]
    one_layer = layer_activation_bytes(spec, precision) * tokens
    saved = layers * (r * h * tokens if ckpt else one_layer)
    saved += (8 * h + a * h) * tokens  # the final norm and the head's input
    layer_casts = 2 * layer * layers if autocast else 0
    head_cast = 2 * emb if autocast else 0
    kept_casts = 0 if ckpt else layer_casts  # saved for the backward without checkpointing
    gathered = w * (emb + 2 * layer)
    forward_end = (layer_casts + head_cast, gathered, saved + LOGITS_FWD * tokens * vocab)
    loss_backward = (kept_casts + head_cast, gathered, saved + LOGITS_BWD * tokens * vocab)
    recomputed = 0
    if ckpt:  # one layer's forward again, its casts, and the hidden state's gradients
        recomputed = one_layer + 2 * r * h * tokens
        kept_casts = 2 * layer if autocast else 0
    layers_backward = (kept_casts, w * (2 * emb + 3 * layer), saved + recomputed)
    return max((forward_end, loss_backward, layers_backward), key=sum)


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
