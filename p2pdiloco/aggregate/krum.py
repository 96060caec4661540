"""Krum and multi-Krum (Blanchard et al., NeurIPS 2017).

Shapes as in ``exact.py``. Each learner i is scored by the sum of its squared distances to its
M − f − 2 nearest other learners; honest deltas cluster, so they score low. Distances come from
``pairwise_sq_dists64`` (float64, fixed pairwise tree), scores are ``math.fsum`` of the sorted
nearest distances, and ties go to the lowest learner index: the selection, and so the result,
is identical on every honest syncer. A merge (``select``) sums the distances window by window
(``SqSums``: the same partials) and then averages the chosen rows window by window, so it never
stacks the M deltas (ADR 0030).
"""

from __future__ import annotations

import math

import torch

from .base import AggregationRule, check_int
from .exact import pairwise_sq_dists64
from .mean import Mean, weighted_mean64
from .rows import RowSet


def krum_scores(delta_MD: torch.Tensor, f: int) -> list[float]:
    """Krum score of each learner: Σ of its M − f − 2 smallest squared distances to others.

    Raises ValueError unless M > 2f + 2.
    """
    _check_m(delta_MD.shape[0], f)
    return _scores(pairwise_sq_dists64(delta_MD), f)


def krum_ranking(delta_MD: torch.Tensor, f: int) -> list[int]:
    """Learner indices from best (lowest score) to worst; ties by lowest index."""
    return _ranking(krum_scores(delta_MD, f))


def windowed_ranking(deltas: RowSet, rows: list[int], f: int) -> list[int]:
    """``krum_ranking`` of ``rows`` of ``deltas`` (positions in ``rows``), the distances summed
    window by window: bit-identical, and no [M, D] stack."""
    _check_m(len(rows), f)
    return _ranking(_scores(deltas.pairwise_sq_dists(rows), f))


def _check_m(m: int, f: int) -> None:
    if m <= 2 * f + 2:
        raise ValueError(f"krum with f={f} needs more than 2f + 2 = {2 * f + 2} learners, got {m}")


def _scores(dist: list[list[float]], f: int) -> list[float]:
    m = len(dist)
    k = m - f - 2
    return [math.fsum(sorted(dist[i][:i] + dist[i][i + 1 :])[:k]) for i in range(m)]


def _ranking(scores: list[float]) -> list[int]:
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

    def select(
        self, deltas: RowSet, rows: list[int], weights: list[float] | None
    ) -> tuple[list[int], AggregationRule, list[float] | None]:
        # The unweighted mean of one row is that row, bit for bit (float64 and back).
        return [rows[windowed_ranking(deltas, rows, self.f)[0]]], Mean(), None


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

    def select(
        self, deltas: RowSet, rows: list[int], weights: list[float] | None
    ) -> tuple[list[int], AggregationRule, list[float] | None]:
        count = len(rows) - self.f if self.m is None else self.m
        chosen = sorted(windowed_ranking(deltas, rows, self.f)[:count])
        # ``Mean`` on the chosen rows is ``weighted_mean64`` of them: the same sums in the same
        # order, and the same fallback to their unweighted mean at zero total weight.
        picked = None if weights is None else [weights[t] for t in chosen]
        return [rows[t] for t in chosen], Mean(), picked
