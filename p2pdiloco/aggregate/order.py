"""Coordinate-wise order statistics: median and trimmed mean (Yin et al. 2018).

Shapes as in ``exact.py``; here a block is n columns, ``key_Mn`` its sort keys, K kept rows.

Each coordinate is sorted across learners by a comparison network (``network.py``: element-wise
min/max, so the sorted values are bit-exact anywhere); -0.0 is first canonicalised to +0.0
(``x + 0.0``) so that equal values are also equal bit patterns. With weights, the network sorts
int64 keys instead: the float's bits mapped to an order-preserving int32 in the high half, the
learner index in the low half, so ties go by learner index and integer min/max stay exact. A
sorted key gives back its value (the high half, mapped back) and its learner's weight
(``index_select``). Every float64 sum runs in sorted order, as in the odd-even transposition
sort this replaced: same bits, 3–6× faster (ADR 0030). All ops stay within ``GRAIN`` elements.
"""

from __future__ import annotations

import math
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import partial

import torch

from .base import AggregationRule, check_int
from .exact import GRAIN, blocks
from .network import Sorter, row_chunks

_MAGNITUDE = 0x7FFFFFFF
_LOW32 = 0xFFFFFFFF
_HIGH = 1 if sys.byteorder == "little" else 0  # the int32 half of an int64 key holding the value


def block_cols(m: int, rows: int) -> int:
    """Columns per block such that the network's widest op (a progression of ⌊m/2⌋
    comparators) and the callers' ops on ``rows`` rows stay within ``GRAIN`` elements; ops on
    all m rows are split into row chunks."""
    return max(64, GRAIN // max(1, m // 2, rows))


class _Plan:
    """One block width's sorter, buffers and ops, made once and kept per thread (``_plan``:
    never shared between threads); ``run`` merges one block. The ops after the sort are bound
    to fixed views like the sorter's: made per block, the views cost about as much as the ops."""

    def __init__(self, m: int, n: int, f: int, weighted: bool, dev: torch.device):
        """``f`` rows trimmed per side (a trimmed mean), or -1 for the median. With
        ``weighted``, call ``set_weights`` before ``run``."""
        self.m, self.n, self.dev = m, n, dev
        median = f < 0
        lo_row, hi_row = (m - 1) // 2, m // 2
        wanted = list(range(f, m - f)) if not median else [lo_row, hi_row]
        if median and weighted:
            wanted = list(range(m))
        self.weighted = weighted
        self.sorter = Sorter(m, n, torch.int64 if weighted else torch.float32, dev, wanted)
        srt = self.sorter.out
        self.ops: list[Callable[[], object]] = []
        self.check: Callable[[], bool] | None = None
        self.fallback: list[Callable[[], object]] = []
        if weighted:
            self.v_Mn = self._buf(m, torch.float32)
            self.t_Mn = self._buf(m, torch.int32)
            self.shift = torch.tensor(31, dtype=torch.int32, device=dev)  # faster than 31
            learner_M1 = torch.arange(m, device=dev).view(m, 1)
            self.keys = [
                (rs, self.t_Mn[rs], self.sorter.src[rs], learner_M1[rs]) for rs in row_chunks(m, n)
            ]
            self.w_M = w_M = torch.zeros(m, dtype=torch.float64, device=dev)
            self.half = torch.zeros((), dtype=torch.float64, device=dev)
        if median:
            acc = self._buf(1, torch.float64)[0]
            if not weighted:
                self.ops += [partial(acc.copy_, srt[lo_row]), partial(acc.add_, srt[hi_row])]
            else:
                self._weighted_median(srt, w_M, self.half, acc)
            self.ops.append(partial(acc.mul_, 0.5))
            self.result = acc
            return
        k = m - 2 * f
        kept = srt[f : m - f] if not weighted else self._values(srt[f : m - f])
        plain = self._buf(1, torch.float64)[0]
        plain_ops: list[Callable[[], object]] = [partial(plain.copy_, kept[0])]
        plain_ops += [partial(plain.add_, kept[r]) for r in range(1, k)]
        count = torch.tensor(float(k), dtype=torch.float64, device=dev)  # a true division
        plain_ops.append(partial(plain.div_, count))
        if not weighted:
            self.ops, self.result = plain_ops, plain
            return
        w = self._weights(w_M, srt[f : m - f])
        num = self._buf(k, torch.float64)
        self.ops += [partial(num.copy_, kept), partial(num.mul_, w)]  # w · v, float64
        for r in range(1, k):
            self.ops += [partial(num[0].add_, num[r]), partial(w[0].add_, w[r])]
        self.ops.append(partial(num[0].div_, w[0]))
        # Where the kept learners all weigh 0, their unweighted mean: rare, so one check per
        # block rather than a ``where`` on every column.
        self.check = lambda: bool(w[0].gt(0).all())
        self.fallback = [*plain_ops, lambda: torch.where(w[0] > 0, num[0], plain, out=num[0])]
        self.result = num[0]

    def _buf(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(rows, self.n, dtype=dtype, device=self.dev)

    def _flip(self, bits: torch.Tensor, out: torch.Tensor) -> list[Callable[[], object]]:
        """Ops of the order-preserving involution between float32 bit patterns and int32
        (negatives get their magnitude bits inverted), so that integer order is float order."""
        return [
            partial(torch.bitwise_right_shift, bits, self.shift, out=out),
            partial(out.bitwise_and_, _MAGNITUDE),
            partial(out.bitwise_xor_, bits),
        ]

    def _values(self, key_Kn: torch.Tensor) -> torch.Tensor:
        """The float32 values of sorted keys (their high halves, flipped back)."""
        out = self._buf(key_Kn.shape[0], torch.float32)
        self.ops += self._flip(key_Kn.view(torch.int32)[:, _HIGH::2], out.view(torch.int32))
        return out

    def _weights(self, w_M: torch.Tensor, key_Kn: torch.Tensor) -> torch.Tensor:
        """Each sorted key's learner weight, float64 [K, n] (``take`` would go to the thread
        pool at this size)."""
        k = key_Kn.shape[0]
        idx, out = self._buf(k, torch.int64), self._buf(k, torch.float64)
        for rs in row_chunks(k, self.n):
            self.ops.append(partial(torch.bitwise_and, key_Kn[rs], _LOW32, out=idx[rs]))
            flat_idx, flat_out = idx[rs].view(-1), out[rs].view(-1)
            self.ops.append(partial(torch.index_select, w_M, 0, flat_idx, out=flat_out))
        return out

    def _weighted_median(
        self, srt: torch.Tensor, w_M: torch.Tensor, half: torch.Tensor, acc: torch.Tensor
    ) -> None:
        m = self.m
        cw = self._weights(w_M, srt)
        self.ops += [partial(cw[k].add_, cw[k - 1]) for k in range(1, m)]  # in sorted order
        # The running weight never decreases: the rows below half (or at most half) are the
        # first ones; their count is the row of the first that reaches (or exceeds) it, or the
        # last row where none does. Integer sums are exact in any order.
        below_Mn = self._buf(m, torch.bool)  # a comparison into any other dtype is ~50× slower
        cnt_Mn = below_Mn.view(torch.uint8) if m < 256 else self._buf(m, torch.int32)
        pos_1n, key_1n = self._buf(1, torch.int64), self._buf(1, torch.int64)
        for strict in (False, True):
            below = torch.le if strict else torch.lt
            for rs in row_chunks(m, self.n):
                self.ops.append(partial(below, cw[rs], half, out=below_Mn[rs]))
                if m >= 256:
                    self.ops.append(partial(cnt_Mn[rs].copy_, below_Mn[rs]))
            r = m
            while r > 1:
                h = r // 2
                self.ops.append(partial(cnt_Mn[:h].add_, cnt_Mn[r - h : r]))
                r -= h
            self.ops += [
                partial(pos_1n.copy_, cnt_Mn[:1]),
                partial(pos_1n.clamp_, max=m - 1),
                partial(torch.gather, srt, 0, pos_1n, out=key_1n),
            ]
            val = self._values(key_1n)[0]
            self.ops.append(partial(acc.add_, val) if strict else partial(acc.copy_, val))

    def set_weights(self, weights: list[float]) -> None:
        self.w_M.copy_(torch.tensor(weights, dtype=torch.float64))
        self.half.fill_(math.fsum(weights) / 2)

    def run(self, block_Mn: torch.Tensor, out_n: torch.Tensor) -> None:
        if not self.weighted:
            self.sorter.load(block_Mn)
        else:
            for rs, t, key, learner in self.keys:
                v = self.v_Mn[rs]
                torch.add(block_Mn[rs], 0.0, out=v)  # -0.0 → +0.0
                for op in self._flip(v.view(torch.int32), t):
                    op()
                key.copy_(t).bitwise_left_shift_(32).bitwise_or_(learner)
        self.sorter.run()
        for op in self.ops:
            op()
        if self.check is not None and not self.check():
            for op in self.fallback:
                op()
        out_n.copy_(self.result)


# Plans are reused across calls (a merge calls the rule once per window): per thread, since a
# plan's buffers are its working memory, and only the last few.
_PLANS = threading.local()
_KEPT_PLANS = 8


def _plan(m: int, n: int, f: int, weights: list[float] | None, dev: torch.device) -> _Plan:
    made: OrderedDict[tuple, _Plan] = _PLANS.__dict__.setdefault("made", OrderedDict())
    key = (m, n, f, weights is not None, str(dev))
    plan = made.pop(key, None) or _Plan(m, n, f, weights is not None, dev)
    made[key] = plan
    while len(made) > _KEPT_PLANS:
        made.popitem(last=False)
    if weights is not None:
        plan.set_weights(weights)
    return plan


def _order_stat(
    out_D: torch.Tensor, delta_MD: torch.Tensor, f: int, weights: list[float] | None
) -> torch.Tensor:
    """Median (``f`` = -1) or ``f``-trimmed mean of each column into ``out_D``, block by block."""
    m, d = delta_MD.shape
    n = block_cols(m, 1 if f < 0 else m - 2 * f)
    for s, e in blocks(d, n):
        if s == 0 or e - s < n:
            plan = _plan(m, e - s, f, weights, delta_MD.device)
        plan.run(delta_MD[:, s:e], out_D[s:e])
    return out_D


def median64(delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
    """Coordinate-wise (weighted) median, float64 [D]; see ``CoordinateMedian``."""
    out_D = torch.empty(delta_MD.shape[1], dtype=torch.float64, device=delta_MD.device)
    return _order_stat(out_D, delta_MD, -1, weights)


class CoordinateMedian(AggregationRule):
    """Per coordinate, the median of the M learners' values.

    Unweighted (``weights=None``): the middle value, or for even M the mean of the two middle
    values. Weighted: the midpoint of the weighted medians, i.e. ``(lo + hi) / 2`` where ``lo``
    is the smallest value whose cumulative weight (in sorted order) reaches half the total and
    ``hi`` the smallest whose cumulative weight exceeds it; with equal weights this is exactly
    the unweighted median, and zero-weight learners never influence it. Cumulative weights are
    float64 sums, so an exact half-weight tie is only recognised as such when the sums are exact
    (always for integer token counts below 2**53).

    Robustness: breakdown point 1/2 per coordinate (fewer than half the learners, or under half
    of the total weight, cannot drag any coordinate outside the honest range), no
    hyperparameter. It is noisier than the mean on honest data (efficiency ~64% for Gaussian
    noise) and is vulnerable to small coordinated shifts (ALIE); prefer ``trimmed_mean`` when
    you know a bound on attackers. Cost at M = 8: ~1.5× the mean, ~4× with weights
    (``bench/aggregate.py``, ``docs/benchmarks.md``).
    """

    name = "median"
    coordinatewise = True

    def aggregate(self, delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
        out_D = torch.empty(delta_MD.shape[1], dtype=torch.float32, device=delta_MD.device)
        return _order_stat(out_D, delta_MD, -1, weights)


class TrimmedMean(AggregationRule):
    """Per coordinate, drop the ``f`` largest and ``f`` smallest values, average the rest.

    With weights, the kept values are averaged with their own weights (a coordinate whose kept
    learners all have zero weight falls back to their unweighted mean); trimming counts
    learners, not weight. Values and sums are float64 in sorted order; one rounding at the end.

    Tuning: ``f`` must be at least the number of attacking learners you want to tolerate in
    this committee's input; f = ceil(M/4) is a common default, and f ≥ M/2 is impossible.
    Every extra unit of f discards honest data (more variance). With f attackers the result
    of each coordinate stays within the range of the honest values.

    Raises ValueError unless M > 2f (``min_learners`` = 2f + 1).
    """

    name = "trimmed_mean"
    coordinatewise = True

    def __init__(self, f: int = 1) -> None:
        self.f = check_int("f", f, 0)

    @property
    def min_learners(self) -> int:
        return 2 * self.f + 1

    def params(self) -> dict[str, object]:
        return {"f": self.f}

    def aggregate(self, delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
        out_D = torch.empty(delta_MD.shape[1], dtype=torch.float32, device=delta_MD.device)
        return _order_stat(out_D, delta_MD, self.f, weights)
