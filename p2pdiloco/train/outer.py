"""The outer step of DiLoCo: Nesterov SGD on pseudo-gradients, over parameter fragments.

Pseudo-gradient of one learner: Δ = θ_base − θ_local (what the learner's inner steps moved,
with the sign of a gradient). The outer optimizer treats the merged Δ as a gradient:

    b ← μ·b + Δ                 (momentum buffer, starts at zero)
    θ ← θ − η·(Δ + μ·b)         (Nesterov; without it θ ← θ − η·b)

which is ``torch.optim.SGD(nesterov=True, dampening=0)``. Each operation is a separate
element-wise IEEE op in fp32 (no fused multiply-add, no reductions), so every honest syncer that
applies the same merged Δ to the same state gets bit-identical results on any machine.

With error feedback (``params_step_``, ADR 0064) the step is not applied as computed: what the
parameters would change by, plus the residual the committee kept last time, is encoded with
the update codec, the parameters move by exactly its decoded value and the rest stays in the
residual, so a follower repeats the step with the update alone: θ ← θ + decode(u).

Fragments (Streaming DiLoCo) are a balanced partition of the named tensors; a fragment is synced
on its own schedule and the outer step only touches that fragment's tensors and momentum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from p2pdiloco.compress.base import Codec, Encoded
from p2pdiloco.train.configs import OuterConfig

MOMENTUM_PREFIX = "outer.momentum."
RESIDUAL_PREFIX = "outer.residual."  # the committee's error feedback of the update (ADR 0064)


def partition_fragments(sizes: Mapping[str, int], num_fragments: int) -> list[list[str]]:
    """Split named tensors into ``num_fragments`` groups of near-equal total size.

    Greedy longest-processing-time: largest tensor first into the currently lightest fragment
    (ties to the lowest index), then each fragment lists its names in the original order.
    Deterministic for a given ordered mapping. Raises ValueError if ``num_fragments`` is below 1
    or above the number of tensors (a fragment must not be empty).
    """
    names = list(sizes)
    if not 1 <= num_fragments <= len(names):
        raise ValueError(f"fragments must be between 1 and {len(names)}, not {num_fragments}")
    order = {n: i for i, n in enumerate(names)}
    loads = [0] * num_fragments
    members: list[list[str]] = [[] for _ in range(num_fragments)]
    for name in sorted(names, key=lambda n: (-sizes[n], order[n])):
        k = min(range(num_fragments), key=lambda j: (loads[j], j))
        loads[k] += sizes[name]
        members[k].append(name)
    return [sorted(m, key=order.__getitem__) for m in members]


def pseudo_gradient(
    base: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor], names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Δ = θ_base − θ_local for ``names``, in fp32."""
    return {n: base[n].float() - local[n].float() for n in names}


@torch.no_grad()
def outer_update_(p: torch.Tensor, buf: torch.Tensor, g: torch.Tensor, cfg: OuterConfig) -> None:
    """One outer step of ``p`` and its momentum ``buf`` (in place) by the merged pseudo-gradient
    ``g`` (float32): element-wise only, so a slice of a tensor gets the very bits it would get
    in a step of the whole tensor (the merge applies it window by window)."""
    mu, lr = cfg.momentum, cfg.lr
    buf.mul_(mu)
    buf.add_(g)
    if cfg.nesterov:
        update = buf * mu
        update.add_(g)
    else:
        update = buf.clone()
    update.mul_(lr)
    p.copy_((p.float() - update).to(p.dtype))


@torch.no_grad()
def params_step_(
    p: torch.Tensor,
    buf: torch.Tensor,
    residual: torch.Tensor,
    g: torch.Tensor,
    cfg: OuterConfig,
    codec: Codec,
    shape: tuple[int, ...],
) -> Encoded:
    """The outer step of flat ``p``, ``buf`` and ``residual`` (in place) sent as the change of
    the parameters, with error feedback: ``buf`` steps with the exact ``g`` (``outer_update_``),
    ``v = (θ_stepped − θ) + residual`` is encoded as a tensor of ``shape``, ``θ ← θ + decode``
    and ``residual ← v − decode``. Returns the encoding: ``θ + decode`` is the whole of what a
    follower computes, one fp32 add, so it gets the committee's bits."""
    stepped = p.detach().float().clone()
    outer_update_(stepped, buf, g, cfg)
    v = stepped.sub_(p.float()).add_(residual)
    enc = codec.encode(v.view(shape))
    sent = codec.decode(enc).reshape(-1).to(p.device)
    residual.copy_(v.sub_(sent))
    p.copy_(apply_params_step(p, sent))
    return enc


def apply_params_step(p: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """θ + decode(u) in fp32, cast to θ's dtype: the committee's step and a follower's alike."""
    return (p.float() + sent.float()).to(p.dtype)
