"""Norm-based defences: input screening, per-learner norm clipping, and centered clipping
(Karimireddy, He & Jaggi, ICML 2021).

Shapes as in ``exact.py``. All norms are ``sq_norms64`` (float64, fixed pairwise tree) followed
by ``math.sqrt``; scale factors are Python floats; updates are element-wise in float64.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .base import AggregationRule, _check_deltas, check_int, check_positive
from .exact import div_, median_of, row_sum64, sq_norms64
from .order import median64


@dataclass(frozen=True)
class ScreenResult:
    """Outcome of ``screen``: accepted learner indices (ascending) and a short reason for each
    rejected one (log it with the peer id)."""

    accepted: list[int]
    rejected: dict[int, str]
    norms: dict[int, float] = field(default_factory=dict)  # L2 norm of each well-formed delta


def screen(
    deltas: torch.Tensor | Sequence[torch.Tensor],
    *,
    expected_numel: int | None = None,
    norm_factor: float | None = 3.0,
    reference: Sequence[int] | None = None,
) -> ScreenResult:
    """Reject malformed or outsized deltas before aggregation.

    ``deltas`` is a [M, D] tensor or a sequence of M tensors of any shape (flattened). A learner
    is rejected, with the first failing reason, if its delta is not a floating-point tensor,
    has the wrong number of elements, holds a NaN/inf, or has an L2 norm above ``norm_factor``
    × the median norm of the *other* well-formed deltas (``None`` disables the norm check): a
    delta never sets its own limit, so with two inputs a 4× flip is compared with the honest
    one's norm, not with their mean (protocol 6, ADR 0027). With ``reference``, the median is
    over the other well-formed deltas among those row indices (trusted senders), so the rest
    cannot move it, unless none of them is well formed. A delta with no other to compare with
    passes the norm check.

    ``expected_numel`` should come from the fragment spec; when None, the most common size wins
    (ties to the size seen first), which a majority of malformed inputs could subvert.
    Tuning: honest DiLoCo deltas of one round have similar norms (spread well within 2×), so
    3× rejects scaling attacks while leaving honest stragglers alone; lower it to ~2 with many
    learners, never below ~1.5. With two well-formed deltas each is held to 3× the other: the
    larger one goes if they differ by more (a flip or a scaled copy does more harm than a tiny
    delta), and the smallest delta of a round always passes, so screening never empties a
    round of well-formed deltas. Where the others' median norm is 0, only zero deltas pass.
    Never raises on bad deltas (that is its job); raises ValueError only for a bad
    ``expected_numel`` or ``norm_factor``.
    """
    if isinstance(deltas, torch.Tensor) and deltas.dim() != 2:
        raise ValueError(
            f"deltas must be [M, D] or a sequence of tensors, got {tuple(deltas.shape)}"
        )
    rows: list[object] = list(deltas)
    if expected_numel is not None and (
        isinstance(expected_numel, bool)
        or not isinstance(expected_numel, int)
        or expected_numel < 0
    ):
        raise ValueError(f"expected_numel must be a non-negative integer, got {expected_numel!r}")
    if norm_factor is not None:
        check_positive("norm_factor", norm_factor)
    rejected: dict[int, str] = {}
    tensors: dict[int, torch.Tensor] = {}
    for i, t in enumerate(rows):
        if not isinstance(t, torch.Tensor):
            rejected[i] = f"not a tensor ({type(t).__name__})"
        elif not t.dtype.is_floating_point:
            rejected[i] = f"dtype {t.dtype} is not floating point"
        else:
            tensors[i] = t
    if expected_numel is None and tensors:
        counts = Counter(t.numel() for t in tensors.values())
        best = max(counts.values())
        expected_numel = next(t.numel() for t in tensors.values() if counts[t.numel()] == best)
    norms: dict[int, float] = {}  # squared, until judged
    sized = [i for i, t in tensors.items() if t.numel() == expected_numel]
    for i in tensors.keys() - set(sized):
        rejected[i] = f"numel {tensors[i].numel()} != expected {expected_numel}"
    if sized:
        # One batched norm pass; a NaN/inf anywhere makes the float64 sum of squares non-finite
        # (finite float32 squares cannot overflow it).
        flat_KD = torch.stack([tensors[i].detach().reshape(-1).float() for i in sized])
        norms = dict(zip(sized, sq_norms64(flat_KD), strict=True))
    return judge_norms(len(rows), norms, rejected, norm_factor, reference)


def judge_norms(
    count: int,
    sq_norms: dict[int, float],
    rejected: dict[int, str],
    norm_factor: float | None,
    reference: Sequence[int] | None = None,
) -> ScreenResult:
    """The verdict of ``screen`` from the squared norms of the well-formed rows (``rejected``
    holds the others): a non-finite one is rejected, then every norm above ``norm_factor`` ×
    the median of the *other* rows' norms (of the other ``reference`` rows when any is well
    formed; leave-one-out, ADR 0027). Shared with the merge, which sums the norms window by
    window (``RowSet.sq_norms``)."""
    rejected = dict(rejected)
    norms: dict[int, float] = {}
    for i, sq in sq_norms.items():
        if math.isfinite(sq):
            norms[i] = math.sqrt(sq)
        else:
            rejected[i] = "non-finite values"
    if norm_factor is not None and norms:
        anchored = {i for i in reference or () if i in norms}
        pool = sorted(anchored or norms, key=lambda j: norms[j])  # by norm: one sort per round
        rank = {j: r for r, j in enumerate(pool)}
        for i, nrm in norms.items():
            med = _median_without(pool, norms, rank.get(i))
            if med is None:  # nothing to compare with (a lone delta, or the lone anchor)
                continue
            if nrm > norm_factor * med:
                rejected[i] = f"norm {nrm:.4g} > {float(norm_factor)!r} × median {med:.4g}"
    accepted = [i for i in range(count) if i not in rejected]
    return ScreenResult(accepted, dict(sorted(rejected.items())), norms)


def _median_without(pool: list[int], norms: dict[int, float], skip: int | None) -> float | None:
    """``median_of`` the norms of ``pool`` (sorted by norm) less its entry at rank ``skip``, in
    O(1): the same values and the same arithmetic, so the same float. None if nothing is left."""
    n = len(pool) - (skip is not None)
    if n == 0:
        return None

    def at(k: int) -> float:  # the k-th smallest once ``skip`` is taken out
        return norms[pool[k if skip is None or k < skip else k + 1]]

    k = n // 2
    return at(k) if n % 2 else (at(k - 1) + at(k)) / 2


def clip_norms(deltas: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale each learner's delta down to L2 norm ``max_norm`` if it is longer; a new float32
    [M, D] tensor (input untouched).

    The scaled row is ``(d_i · (max_norm / ‖d_i‖))`` in float64, rounded once to float32, so its
    norm may exceed ``max_norm`` by a few float32 ulps. Tuning: a bound on a delta's influence
    when combined with ``mean``; set it around the median honest norm (e.g. from
    ``screen(...).norms``) times 1–2. Raises ValueError for non-finite or non-2-D deltas and a
    non-positive ``max_norm``.
    """
    delta_MD = _check_deltas(deltas)
    limit = check_positive("max_norm", max_norm)
    out_MD = delta_MD.clone()
    with torch.no_grad():
        for i, sq in enumerate(sq_norms64(delta_MD)):
            nrm = math.sqrt(sq)
            if nrm > limit:
                out_MD[i].copy_(delta_MD[i].double().mul_(limit / nrm))
    return out_MD


class CenteredClip(AggregationRule):
    """Centered clipping: ``v ← v + Σ w_i clip(d_i − v, τ) / Σ w_i`` for ``iters`` rounds, with
    ``clip(x, τ) = x · min(1, τ/‖x‖)``, starting from the coordinate-wise (weighted) median.

    The paper starts from the previous round's aggregate (momentum); a syncer committee has no
    such state of its own, and the median is the robust stand-in. ``v`` stays float64 across
    iterations and is rounded to float32 once.

    Tuning: ``tau`` is absolute by default (same units as the deltas): set it near the typical
    honest distance ‖d_i − mean‖, e.g. the median of ``screen(...).norms`` for independent
    learners. Too small and the rule barely moves from the median; too large and it approaches
    the (non-robust) mean. ``relative=True`` makes ``tau`` a multiple of the median of
    ‖d_i − v0‖ measured each call, which is scale-free (``tau=1.0`` is a sensible start). An
    attacker moves the result by at most ``tau`` × its weight share per iteration, so keep
    ``iters`` small (1–5); 3 is the paper's setting. Raises ValueError for tau ≤ 0 or iters < 1.
    """

    name = "centered_clip"

    def __init__(self, tau: float = 1.0, iters: int = 3, relative: bool = False) -> None:
        self.tau = check_positive("tau", tau)
        self.iters = check_int("iters", iters, 1)
        self.relative = bool(relative)

    def params(self) -> dict[str, object]:
        return {"tau": self.tau, "iters": self.iters, "relative": self.relative}

    def aggregate(self, delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
        m = delta_MD.shape[0]
        rows = range(m)
        w = weights if weights is not None else [1.0] * m
        total = math.fsum(w)
        v_D = median64(delta_MD, weights)
        tau = self.tau
        for it in range(self.iters):
            dist = [math.sqrt(sq) for sq in sq_norms64(delta_MD, center_D=v_D)]
            if it == 0 and self.relative:
                tau = self.tau * median_of(dist)
            coef = [w[i] * (1.0 if dist[i] <= tau else tau / dist[i]) for i in rows]
            v_D.add_(div_(row_sum64(delta_MD, rows, coef=coef, center_D=v_D), total))
        return v_D.float()
