"""The merge: agreed deltas → screened → robust rule → outer step → new state. The only one.

The syncer service runs it on a round's agreed submissions (in a worker thread), the simulator
on each fragment's deltas, the tests directly. Pure tensor work, no IO. Every honest syncer that
merges the same inputs (same deltas, same weights, same order) from the same certified state
gets a bit-identical result (the rules and the outer step are element-wise or fixed-order;
ADR 0005), which is what lets their signatures over the state hash match.

Shapes: M inputs, D parameters (the tensors named in ``params``, flattened in sorted-name order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from p2pdiloco.aggregate import get_rule, screen
from p2pdiloco.aggregate.base import sq_norms64
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.train.outer import OuterConfig, OuterOptimizer


@dataclass(frozen=True)
class MergeInput:
    """One agreed submission, decoded: its id, its sender, its delta per tensor, its weight.

    ``weight`` comes from ``sync.weights.merge_weights`` (tokens / (1 + lag), capped at
    ``SyncRules.weight_cap``), computed over the whole input set in sorted-id order.
    """

    digest: str
    peer_id: str
    delta: Mapping[str, torch.Tensor]  # at least the names being merged; others are ignored
    weight: float
    trusted: bool = True  # its norm anchors screening (sync.trust: probationary ones do not)


@dataclass
class MergeResult:
    params: dict[str, torch.Tensor]  # the merged names, float32, on the device of ``params``
    momentum: dict[str, torch.Tensor]  # outer Nesterov buffers of the merged names
    accepted: list[str]  # digests merged, in input order
    rejected: dict[str, str] = field(default_factory=dict)  # digest → screening reason
    rule: str = ""  # the rule actually applied (a fallback is named here)


class MergeError(ValueError):
    """No merge this round: screening rejected every delta (or there were none).

    ``rejected`` maps each input's digest to its reason. The round certifies nothing; the
    certified state stays as it was.
    """

    def __init__(self, message: str, rejected: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.rejected = dict(rejected or {})


def merge_round(
    params: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    inputs: Sequence[MergeInput],
    *,
    rules: SyncRules,
    outer: OuterConfig,
) -> MergeResult:
    """The next state of the tensors named in ``params`` (left untouched, as is ``momentum``).

    Merges only the names in ``params``, so a caller may pass one fragment. Each input's delta
    must hold every such name; a missing tensor or a wrong shape rejects that input, like
    screening does (finite, size, norm ≤ ``rules.screen_norm_factor`` × the median norm of the
    trusted inputs, so probationary ones cannot move it, and a probationary delta must not point
    away from the trusted inputs' mean: ``sync.trust``). The rule
    ``rules.aggregation`` merges the rest with the inputs' weights. If fewer remain than the
    rule needs, the coordinate median is used instead (named in ``MergeResult.rule``), so a
    round that closed with few learners still produces a state. A name without a momentum
    buffer starts from zero.

    Raises MergeError if no input survives screening, and ValueError from ``get_rule`` for rule
    parameters the rule refuses (``sync.rules.check_supported`` catches those up front).
    """
    names = sorted(params)
    chosen = get_rule(rules.aggregation, **rules.aggregation_params)
    rejected: dict[str, str] = {}
    rows: list[int] = []
    for i, inp in enumerate(inputs):
        reason = _shape_mismatch(inp.delta, params, names)
        if reason:
            rejected[inp.digest] = reason
        else:
            rows.append(i)
    if not rows:
        raise MergeError("no delta of the round has the model's tensors", rejected)
    delta_MD = torch.stack(
        [torch.cat([inputs[i].delta[n].float().reshape(-1) for n in names]) for i in rows]
    )
    anchors = [j for j, i in enumerate(rows) if inputs[i].trusted]
    verdict = screen(
        delta_MD,
        expected_numel=delta_MD.shape[1],
        norm_factor=rules.screen_norm_factor,
        reference=anchors if len(anchors) < len(rows) else None,
    )
    trusted = [inputs[i].trusted for i in rows]
    away = _away_from_trusted(delta_MD, verdict.accepted, trusted)
    kept = [j for j in verdict.accepted if j not in away]
    reasons = {**verdict.rejected, **away}
    rejected.update({inputs[rows[j]].digest: reason for j, reason in reasons.items()})
    if not kept:
        raise MergeError("screening rejected every delta of the round", rejected)
    applied = rules.aggregation
    if len(kept) < chosen.min_learners:
        chosen, applied = get_rule("median"), f"median (fallback from {rules.aggregation})"
    weights = [inputs[rows[j]].weight for j in kept]
    merged_D = chosen(delta_MD[kept].contiguous(), weights)

    new_params = {n: params[n].detach().float().clone() for n in names}
    opt = OuterOptimizer(outer)
    opt.momentum = {n: momentum[n].detach().float().clone() for n in names if n in momentum}
    merged, offset = {}, 0
    for n in names:
        size = new_params[n].numel()
        merged[n] = merged_D[offset : offset + size].reshape(new_params[n].shape)
        offset += size
    opt.step(new_params, merged)
    order = {inp.digest: k for k, inp in enumerate(inputs)}
    return MergeResult(
        params=new_params,
        momentum=opt.momentum,
        accepted=[inputs[rows[j]].digest for j in kept],
        rejected=dict(sorted(rejected.items(), key=lambda kv: order[kv[0]])),
        rule=applied,
    )


def _away_from_trusted(
    delta_MD: torch.Tensor, accepted: list[int], trusted: list[bool]
) -> dict[int, str]:
    """Probationary rows (ADR 0016) among ``accepted`` whose delta points away from the mean of
    the accepted trusted rows (a·m ≤ 0), with their reasons. The mean is summed row by row in
    float64 and a·m comes from ``sq_norms64`` (‖a‖² + ‖m‖² − ‖a − m‖²), so every syncer draws
    the same line. Nothing is checked without a trusted row or a probationary one."""
    anchors = [j for j in accepted if trusted[j]]
    fresh = [j for j in accepted if not trusted[j]]
    if not anchors or not fresh:
        return {}
    mean_D = delta_MD[anchors[0]].double().clone()
    for j in anchors[1:]:
        mean_D += delta_MD[j].double()
    mean_D /= len(anchors)
    (m2,) = sq_norms64(mean_D.unsqueeze(0))
    a2s = sq_norms64(delta_MD, fresh)
    d2s = sq_norms64(delta_MD, fresh, center_D=mean_D)
    out = {}
    for j, a2, d2 in zip(fresh, a2s, d2s, strict=True):
        dot = (a2 + m2 - d2) / 2
        if dot <= 0:
            out[j] = f"points away from the trusted inputs' mean (a·m = {dot:.3g})"
    return out


def _shape_mismatch(
    delta: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], names: list[str]
) -> str:
    for n in names:
        t = delta.get(n)
        if t is None:
            return f"missing tensor {n!r}"
        if tuple(t.shape) != tuple(params[n].shape):
            return f"tensor {n!r} has shape {tuple(t.shape)}, not {tuple(params[n].shape)}"
    return ""
