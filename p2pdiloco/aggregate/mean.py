"""Weighted means: the non-robust baseline (and the building block of multi-Krum), and the mean
of each coordinate over the learners that sent it (for sparse codecs).

Shapes as in ``exact.py``: ``delta_MD`` [M, D], result [D].
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import AggregationRule
from .exact import div_, row_sum64


def weighted_mean64(
    delta_MD: torch.Tensor, rows: Sequence[int], weights: list[float] | None
) -> torch.Tensor:
    """``Σ w_i d_i / Σ w_i`` over ``rows`` (learner order), float64 [D].

    If the selected rows carry zero total weight, falls back to their unweighted mean.
    """
    rows = list(rows)
    total = math.fsum(weights[i] for i in rows) if weights is not None else 0.0
    if weights is None or total == 0.0:
        return div_(row_sum64(delta_MD, rows), len(rows))
    return div_(row_sum64(delta_MD, rows, coef=weights), total)


class Mean(AggregationRule):
    """``Σ w_i d_i / Σ w_i``: products and sums in float64 in learner order, one rounding to
    float32 at the end (so the result is finite whenever the inputs are).

    Not robust: one learner can move it arbitrarily far (a single −100× delta flips its sign).
    Use it with ``screen`` and ``clip_norms`` in trusted runs, or as the baseline.
    """

    name = "mean"
    coordinatewise = True

    def aggregate(self, delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
        return weighted_mean64(delta_MD, range(delta_MD.shape[0]), weights).float()


class SenderMean(AggregationRule):
    """Each coordinate's weighted mean over the learners that sent it (a non-zero value there):
    ``Σ w_i d_ij / Σ_{i: d_ij ≠ 0} w_i``, and 0 where no learner sent it. Templar's combiner
    for top-k deltas: a coordinate that one learner of M kept is applied at its full value,
    where ``mean`` divides it by all M.

    Bit-identical to ``mean`` on every coordinate that all learners sent (the same ordered
    float64 sum divided by the same ``fsum`` of the weights); elsewhere the denominator is the
    senders' weights added in learner order in float64. Not robust, and less so than ``mean``
    on sparse deltas: a coordinate that one attacker alone sends is applied at full strength.
    Measured on top-k deltas in ``bench/parity.py`` (docs/adr/0061-parity-best-against-best.md).
    """

    name = "sender_mean"
    coordinatewise = True

    def aggregate(self, delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
        m = delta_MD.shape[0]
        total = math.fsum(weights) if weights is not None else 0.0
        w = weights if weights is not None and total > 0.0 else [1.0] * m
        total = math.fsum(w)
        num_D = row_sum64(delta_MD, range(m), coef=w)
        sent_MD = delta_MD != 0
        den_D = torch.zeros(delta_MD.shape[1], dtype=torch.float64, device=delta_MD.device)
        everyone_D = torch.ones_like(den_D, dtype=torch.bool)
        for i in range(m):
            den_D.add_(sent_MD[i].to(torch.float64).mul_(w[i]))
            everyone_D &= sent_MD[i]
        den_D = torch.where(everyone_D, torch.full_like(den_D, total), den_D)
        some_D = den_D > 0
        out_D = torch.where(some_D, num_D / torch.where(some_D, den_D, 1.0), 0.0)
        return out_D.float()
