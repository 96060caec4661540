"""A syncer's merge: agreed submissions → screened → robust rule → outer step → new state.

Pure tensor work, no IO: the network driver calls it in a worker thread, tests call it directly.
Every honest syncer that merges the same agreed input set from the same certified state gets a
bit-identical result (the rules and the outer step are element-wise or fixed-order; ADR 0005),
which is what lets their signatures over the state hash match.

Shapes: M submissions, D parameters (all tensors, flattened in sorted-name order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from p2pdiloco.aggregate import get_rule, screen
from p2pdiloco.train.outer import OuterConfig, OuterOptimizer


@dataclass(frozen=True)
class MergeInput:
    """One agreed submission, decoded: its id, its sender, its delta per tensor, its weight."""

    digest: str
    peer_id: str
    delta: Mapping[str, torch.Tensor]
    weight: float


@dataclass
class MergeResult:
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]  # outer Nesterov buffers, keyed by parameter name
    accepted: list[str]  # digests merged
    rejected: dict[str, str] = field(default_factory=dict)  # digest → screening reason
    rule: str = ""  # the rule actually applied (a fallback is named here)


def merge_round(
    params: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    inputs: Sequence[MergeInput],
    *,
    rule: str,
    rule_params: Mapping[str, float] | None = None,
    outer: OuterConfig,
    screen_norm_factor: float | None = 3.0,
) -> MergeResult:
    """The next certified state from the certified ``params``/``momentum`` (left untouched).

    Screening (finite, size, norm ≤ factor × median) drops poisoned or malformed deltas; the
    rule merges the rest with their weights. If screening leaves fewer deltas than the rule
    needs, the coordinate median is used instead (recorded in ``rule``), so a round that closed
    with few learners still produces a state. Raises ValueError if every delta is rejected.
    """
    names = sorted(params)
    delta_MD = torch.stack(
        [torch.cat([inp.delta[n].float().reshape(-1) for n in names]) for inp in inputs]
    )
    verdict = screen(delta_MD, expected_numel=delta_MD.shape[1], norm_factor=screen_norm_factor)
    rejected = {inputs[i].digest: reason for i, reason in verdict.rejected.items()}
    if not verdict.accepted:
        raise ValueError("screening rejected every delta of the round")
    chosen = get_rule(rule, **dict(rule_params or {}))
    applied = rule
    if len(verdict.accepted) < chosen.min_learners:
        chosen, applied = get_rule("median"), f"median (fallback from {rule})"
    weights = [inputs[i].weight for i in verdict.accepted]
    merged_D = chosen(delta_MD[verdict.accepted].contiguous(), weights)

    new_params = {n: params[n].detach().to("cpu", torch.float32).clone() for n in names}
    opt = OuterOptimizer(outer)
    opt.momentum = {n: momentum[n].detach().float().clone() for n in momentum}
    merged, offset = {}, 0
    for n in names:
        size = new_params[n].numel()
        merged[n] = merged_D[offset : offset + size].reshape(new_params[n].shape)
        offset += size
    opt.step(new_params, merged)
    return MergeResult(
        params=new_params,
        momentum=opt.momentum,
        accepted=[inputs[i].digest for i in verdict.accepted],
        rejected=rejected,
        rule=applied,
    )
