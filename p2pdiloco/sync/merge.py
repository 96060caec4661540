"""Merging one fragment's deltas robustly: (poison, for experiments) → screen → rule.

Shapes: M learners, D parameters of the fragment, flattened in the fragment's name order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from p2pdiloco.aggregate import get_rule, screen
from p2pdiloco.sync.attacks import AttackConfig, poison


class RobustMerger:
    """Screens and merges learners' deltas with a robust rule, counting verdicts per learner.

    ``adversaries`` (learner indices) have their deltas replaced by ``attack`` before screening,
    which is how the simulator and the demo inject poisoned deltas. Raises ValueError for an
    unknown rule or parameters (at construction), and when screening leaves fewer learners than
    the rule needs (at merge time; the round then has no valid merge).
    """

    def __init__(
        self,
        rule: str,
        params: Mapping[str, float] | None = None,
        *,
        num_learners: int,
        screen_norm_factor: float | None = 3.0,
        adversaries: Sequence[int] = (),
        attack: AttackConfig | None = None,
    ) -> None:
        self.rule = get_rule(rule, **dict(params or {}))
        self.num_learners = num_learners
        self.screen_norm_factor = screen_norm_factor
        self.adversaries = sorted(adversaries)
        self.attack = attack
        self.accepted = [0] * num_learners
        self.rejected = [0] * num_learners
        self.last_reasons: dict[int, str] = {}
        self._previous: dict[tuple[int, tuple[str, ...]], torch.Tensor] = {}

    def merge(
        self, deltas: Sequence[Mapping[str, torch.Tensor]], names: Sequence[str], round_index: int
    ) -> dict[str, torch.Tensor]:
        """The merged delta of fragment ``names`` from every learner's delta (in learner order)."""
        key = tuple(names)
        delta_MD = torch.stack([torch.cat([d[n].float().flatten() for n in names]) for d in deltas])
        if self.adversaries and self.attack is not None:
            honest = [i for i in range(len(deltas)) if i not in self.adversaries]
            honest_MD = delta_MD[honest]
            for i in self.adversaries:
                own = delta_MD[i].clone()
                delta_MD[i] = poison(
                    self.attack,
                    own,
                    honest_MD,
                    num_learners=len(deltas),
                    num_attackers=len(self.adversaries),
                    previous_D=self._previous.get((i, key)),
                    round_index=round_index,
                )
                self._previous[(i, key)] = own
        verdict = screen(
            delta_MD, expected_numel=delta_MD.shape[1], norm_factor=self.screen_norm_factor
        )
        for i in verdict.accepted:
            self.accepted[i] += 1
        for i in verdict.rejected:
            self.rejected[i] += 1
        self.last_reasons = dict(verdict.rejected)
        merged_D = self.rule(delta_MD[verdict.accepted])
        out, offset = {}, 0
        for n in names:
            shape = deltas[0][n].shape
            size = deltas[0][n].numel()
            out[n] = merged_D[offset : offset + size].reshape(shape)
            offset += size
        return out
