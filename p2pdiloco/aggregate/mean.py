"""Weighted mean: the non-robust baseline (and the building block of multi-Krum).

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
