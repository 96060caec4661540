"""What an inner step holds on a device at its peak beside the training state: the terms one
H200 measured (ADR 0049), shared by the one-device estimate (``memory``) and the island plan
(``island_plan``), so that both count the same bytes.

With P parameters, L decoder layers of P_L each, the embedding of E = V × h tied to the head
and T = micro-batch × sequence tokens:

- **casts**, under bf16 autocast only: the bf16 copy of every weight a matmul used, 2 B per
  parameter of the whole model. Autocast caches each cast until the forward leaves its context,
  and without checkpointing autograd keeps them for the backward (FSDP2 resharding a layer frees
  its fp32 weights, not their copies);
- **activations** (``layer_activation_bytes``): without checkpointing what every layer keeps
  for its backward; with it each layer's input (the residual stream), and in the backward one
  layer's recomputed set at a time; plus the final norm and the head's input;
- **logits**: 10 B per token per vocabulary entry at the forward's end (bf16 logits, their fp32
  copy, the log-softmax), 12 B in the loss's backward (the log-softmax and two gradients);
- **unsharded**, at the parameters' dtype: with FSDP2 (no mixed-precision policy: fp32) the root
  (the embedding) gathered for the whole step, one decoder layer and the one prefetched; in the
  layers' backward, with or without FSDP2, the tied head's gradient (held until the embedding's
  own is added to it) and one layer's new gradient before it is reduced or accumulated.

The peak is the largest of three phases (the forward's end, the loss's backward, the layers'
backward), which hold different terms. On one rank of the island's FSDP2 path this lands
0.1–4.0 % above every peak measured (gemma-1b, -4b, and -12b at 2, 6 and 10 layers); on one GPU
without FSDP2 (``fsdp=False``, what ``Learner`` runs) 0.10 GiB under gemma-1b's and 0.03 above
gemma-4b's, the 0.10 GiB that device held at rest beyond the weights and AdamW moments
(``RESIDENT``). Estimates for refusing early; a device's measured peak is what checks them
(``bench/gpu_island.py``).
"""

from __future__ import annotations

from typing import NamedTuple

from p2pdiloco.train.model_specs import ModelSpec, get_spec, parameter_count

ACT_BYTES = {"fp32": 4, "bf16-mixed": 2, "bf16": 2}  # an activation under each precision
PARAM_BYTES = {"fp32": 4, "bf16-mixed": 4, "bf16": 2}  # a parameter (and its gradient)
RESIDUAL_BYTES = {"fp32": 4, "bf16-mixed": 4, "bf16": 2}  # the residual stream's dtype
LOGITS_FWD, LOGITS_BWD = 10, 12  # bytes per token per vocabulary entry, see the docstring
# What an H200 held at rest beyond 12 B per parameter of weights and AdamW moments, 0.06–0.13 GiB
# on every row of docs/data/gpu_island_h200.json (``rest_gib``): buffers, library workspaces.
# Measured, not counted; rounded up. Only the one-device estimate adds it: every FSDP2 row
# measured under the island plan's count without it.
RESIDENT = 2**28


class StepPeak(NamedTuple):
    """Bytes at the step's peak on one device, beside the training state, by term."""

    phase: str  # "forward", "loss backward" or "layers backward"
    casts: int  # autocast's bf16 weight copies
    unsharded: int  # FSDP2's gathered units, and gradients not yet reduced or accumulated
    activations: int  # what the layers, the final norm and the head keep for the backward
    logits: int  # the logits and what the loss makes of them

    @property
    def total(self) -> int:
        return self.casts + self.unsharded + self.activations + self.logits


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
    inputs = 5 * a * h if precision == "bf16-mixed" else 2 * RESIDUAL_BYTES[precision] * h
    attention = 8 * q + 8 * kv + 4 * a * q + a * q
    mlp = 4 * a * i
    return norms + inputs + attention + mlp


def model_parts(name: str) -> tuple[ModelSpec, int, int]:
    """(spec, embedding parameters, parameters of one decoder layer)."""
    spec = get_spec(name)
    embedding = spec.vocab_size * spec.hidden_size
    layer = (parameter_count(name) - embedding - spec.hidden_size) // spec.num_layers
    return spec, embedding, layer


def step_peak(
    name: str, precision: str, b: int, s: int, ckpt: bool = False, fsdp: bool = True
) -> StepPeak:
    """The step's peak on one device at micro-batch ``b`` × ``s`` tokens: the largest of the
    three phases. ``fsdp``: the island's FSDP2 path (whatever its N: nothing here is sharded);
    False: the whole model on one device as ``Learner`` holds it, nothing gathered."""
    spec, emb, layer = model_parts(name)
    h, vocab, layers = spec.hidden_size, spec.vocab_size, spec.num_layers
    tokens = b * s
    autocast = precision == "bf16-mixed"
    w, r, a = PARAM_BYTES[precision], RESIDUAL_BYTES[precision], ACT_BYTES[precision]
    one_layer = layer_activation_bytes(spec, precision) * tokens
    saved = layers * (r * h * tokens if ckpt else one_layer)
    saved += (8 * h + a * h) * tokens  # the final norm and the head's input
    layer_casts = 2 * layer * layers if autocast else 0
    head_cast = 2 * emb if autocast else 0
    kept_casts = 0 if ckpt else layer_casts  # saved for the backward without checkpointing
    gathered = w * (emb + 2 * layer) if fsdp else 0
    forward_end = StepPeak(
        "forward", layer_casts + head_cast, gathered, saved, LOGITS_FWD * tokens * vocab
    )
    loss_backward = StepPeak(
        "loss backward", kept_casts + head_cast, gathered, saved, LOGITS_BWD * tokens * vocab
    )
    recomputed = 0
    if ckpt:  # one layer's forward again, its casts, and the hidden state's gradients
        recomputed = one_layer + 2 * r * h * tokens
        kept_casts = 2 * layer if autocast else 0
    grads = w * (emb + layer)  # the head's and a layer's, not yet reduced or accumulated
    layers_backward = StepPeak(
        "layers backward", kept_casts, gathered + grads, saved + recomputed, 0
    )
    return max((forward_end, loss_backward, layers_backward), key=lambda p: p.total)
