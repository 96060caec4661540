"""Krum and multi-Krum (Blanchard et al., NeurIPS 2017).

Shapes as in ``base.py``. Each learner i is scored by the sum of its squared distances to its
M − f − 2 nearest other learners; honest deltas cluster, so they score low. Distances come from
``pairwise_sq_dists64`` (float64, fixed pairwise tree), scores are ``math.fsum`` of the sorted
nearest distances, and ties go to the lowest learner index: the selection, and so the result,
is identical on every honest syncer.
"""

from __future__ import annotations

import math

import torch

from .base import AggregationRule, check_int, pairwise_sq_dists64
from .mean import weighted_mean64


def krum_scores(delta_MD: torch.Tensor, f: int) -> list[float]:
    """Krum score of each learner: Σ of its M − f − 2 smallest squared distances to others.

    Raises ValueError unless M > 2f + 2.
    """
    m = delta_MD.shape[0]
    if m <= 2 * f + 2:
        raise ValueError(f"krum with f={f} needs more than 2f + 2 = {2 * f + 2} learners, got {m}")
    dist = pairwise_sq_dists64(delta_MD)
    k = m - f - 2
    return [math.fsum(sorted(dist[i][:i] + dist[i][i + 1 :])[:k]) for i in range(m)]


def krum_ranking(delta_MD: torch.Tensor, f: int) -> list[int]:
    """Learner indices from best (lowest score) to worst; ties by lowest index."""
    scores = krum_scores(delta_MD, f)
    return sorted(range(len(scores)), key=lambda i: (scores[i], i))


class Krum(AggregationRule):
    """Return the single delta with the best Krum score, unchanged (bit-exact copy).

    Weights are ignored (a selection has nothing to weight). Tuning: ``f`` ≥ the number of
    attackers to tolerate; the guarantee needs M > 2f + 2 (``min_learners`` = 2f + 3). Krum
    throws away all but one learner's work, so convergence is noticeably slower than with the
    mean on honest data; prefer ``multi_krum``. Raises ValueError when M ≤ 2f + 2.
    """

    name = "krum"

    def __init__(self, f: int = 1) -> None:
        self.f = check_int("f", f, 0)

    @property
    def min_learners(self) -> int:
        return 2 * self.f + 3

    def params(self) -> dict[str, object]:
        return {"f": self.f}

    def aggregate(self, delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
        return delta_MD[krum_ranking(delta_MD, self.f)[0]].clone()


class MultiKrum(AggregationRule):
    """Weighted mean of the ``m`` best-scoring deltas (one scoring pass, as in Blanchard et
    al.'s multi-Krum; averaged in learner order, float64, one final rounding).

    ``m`` defaults to M − f (every learner but the f most suspicious). If the selected learners
    carry zero total weight, their unweighted mean is used. Tuning: ``f`` ≥ the number of
    attackers; smaller ``m`` is more conservative but averages less honest work. Distances are
    squared L2 over the whole fragment, so it catches large or scaled attacks well and small
    coordinated shifts (ALIE) poorly. Raises ValueError when M ≤ 2f + 2 or m > M.
    """

    name = "multi_krum"

    def __init__(self, f: int = 1, m: int | None = None) -> None:
        self.f = check_int("f", f, 0)
        self.m = None if m is None else check_int("m", m, 1)

    @property
    def min_learners(self) -> int:
        return max(2 * self.f + 3, self.m or 0)

    def params(self) -> dict[str, object]:
        return {"f": self.f, "m": self.m}

    def aggregate(self, delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
        count = delta_MD.shape[0] - self.f if self.m is None else self.m
        chosen = sorted(krum_ranking(delta_MD, self.f)[:count])
        return weighted_mean64(delta_MD, chosen, weights).float()
