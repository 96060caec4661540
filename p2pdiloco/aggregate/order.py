"""Coordinate-wise order statistics: median and trimmed mean (Yin et al. 2018).

Shapes as in ``base.py``; here a block is n columns, ``key_Mn`` its sort keys, K kept rows.

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

import torch

from .base import GRAIN, AggregationRule, blocks, check_int
from .network import Sorter, row_chunks

_MAGNITUDE = 0x7FFFFFFF
_LOW32 = 0xFFFFFFFF
_HIGH = 1 if sys.byteorder == "little" else 0  # the int32 half of an int64 key holding the value


def block_cols(m: int, rows: int) -> int:
    """Columns per block such that the network's widest op (a progression of ⌊m/2⌋
    comparators) and the callers' ops on ``rows`` rows stay within ``GRAIN`` elements; ops on
    all m rows are split into row chunks."""
    return max(64, GRAIN // max(1, m // 2, rows))


class _Scratch:
    """One block width's sorter and buffers (made per call: never shared between threads)."""

    def __init__(self, m: int, n: int, weighted: bool, wanted: list[int], dev: torch.device):
        self.m, self.n, self.weighted, self.dev = m, n, weighted, dev
        dtype = torch.int64 if weighted else torch.float32
        self.sorter = Sorter(m, n, dtype, dev, wanted)
        self.bufs: dict[str, torch.Tensor] = {}
        self.learner_M1 = torch.arange(m, device=dev).view(m, 1)
        self.shift = torch.tensor(31, dtype=torch.int32, device=dev)  # a 0-dim shift is faster

    def buf(self, name: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
        if name not in self.bufs:
            self.bufs[name] = torch.empty(rows, self.n, dtype=dtype, device=self.dev)
        return self.bufs[name]

    def sort(self, block_Mn: torch.Tensor) -> torch.Tensor:
        """``block_Mn`` sorted per column: float32 values, or with weights int64 keys."""
        if not self.weighted:
            self.sorter.load(block_Mn)
            return self.sorter.run()
        v_Mn = self.buf("v", self.m, torch.float32)
        t_Mn = self.buf("t", self.m, torch.int32)
        for rs in row_chunks(self.m, self.n):
            v, t = v_Mn[rs], t_Mn[rs]
            torch.add(block_Mn[rs], 0.0, out=v)  # -0.0 → +0.0
            self._flip(v.view(torch.int32), t)
            key = self.sorter.src[rs]
            key.copy_(t).bitwise_left_shift_(32).bitwise_or_(self.learner_M1[rs])
        return self.sorter.run()

    def _flip(self, bits: torch.Tensor, out: torch.Tensor) -> None:
        """Order-preserving involution between float32 bit patterns and int32 (negatives get
        their magnitude bits inverted), so that integer order is float order."""
        torch.bitwise_right_shift(bits, self.shift, out=out)
        out.bitwise_and_(_MAGNITUDE).bitwise_xor_(bits)

    def values(self, key_Kn: torch.Tensor, name: str) -> torch.Tensor:
        """The float32 values of sorted keys (their high halves, flipped back)."""
        out = self.buf(name, key_Kn.shape[0], torch.float32)
        self._flip(key_Kn.view(torch.int32)[:, _HIGH::2], out.view(torch.int32))
        return out

    def weights(self, w_M: torch.Tensor, key_Kn: torch.Tensor) -> torch.Tensor:
        """Each sorted key's learner weight, float64 [K, n]. (``take`` would go to the thread
        pool at this size.)"""
        k = key_Kn.shape[0]
        idx, out = self.buf("idx", k, torch.int64), self.buf("w", k, torch.float64)
        for rs in row_chunks(k, self.n):
            torch.bitwise_and(key_Kn[rs], _LOW32, out=idx[rs])
            torch.index_select(w_M, 0, idx[rs].view(-1), out=out[rs].view(-1))
        return out


class _Widths:
    """The ``_Scratch`` of each block width a call meets (the full one and the last, narrower
    block), made on first use."""

    def __init__(self, m: int, rows: int, weighted: bool, wanted: list[int], dev: torch.device):
        self.n = block_cols(m, rows)
        self.args = m, weighted, wanted, dev
        self.made: dict[int, _Scratch] = {}

    def get(self, n: int) -> _Scratch:
        if n not in self.made:
            m, weighted, wanted, dev = self.args
            self.made[n] = _Scratch(m, n, weighted, wanted, dev)
        return self.made[n]


def _median_into(out_D: torch.Tensor, delta_MD: torch.Tensor, weights: list[float] | None) -> None:
    m, d = delta_MD.shape
    dev = delta_MD.device
    lo_row, hi_row = (m - 1) // 2, m // 2
    wanted = sorted({lo_row, hi_row}) if weights is None else list(range(m))
    widths = _Widths(m, 2, weights is not None, wanted, dev)
    if weights is not None:
        w_M = torch.tensor(weights, dtype=torch.float64, device=dev)
        half = math.fsum(weights) / 2
        count_dtype = torch.uint8 if m < 256 else torch.int32
    for s, e in blocks(d, widths.n):
        sc = widths.get(e - s)
        srt = sc.sort(delta_MD[:, s:e])
        acc = sc.buf("acc", 1, torch.float64)[0]
        if weights is None:
            acc.copy_(srt[lo_row])
            acc.add_(srt[hi_row])
        else:
            cw = sc.weights(w_M, srt)
            for k in range(1, m):  # running weight, in sorted order
                cw[k].add_(cw[k - 1])
            # The running weight never decreases: the rows below half (or at most half) are
            # the first ones; their count is the row of the first that reaches (or exceeds)
            # it, or the last row where none does. Integer sums are exact in any order.
            cnt_Mn, pos_1n = sc.buf("cnt", m, count_dtype), sc.buf("pos", 1, torch.int64)
            key_1n = sc.buf("key", 1, torch.int64)
            for strict in (False, True):
                for rs in row_chunks(m, sc.n):
                    (torch.le if strict else torch.lt)(cw[rs], half, out=cnt_Mn[rs])
                r = m
                while r > 1:
                    h = r // 2
                    cnt_Mn[:h].add_(cnt_Mn[r - h : r])
                    r -= h
                pos_1n.copy_(cnt_Mn[:1]).clamp_(max=m - 1)
                torch.gather(srt, 0, pos_1n, out=key_1n)
                val = sc.values(key_1n, "val")[0]
                acc.add_(val) if strict else acc.copy_(val)
        acc.mul_(0.5)
        out_D[s:e].copy_(acc)


def median64(delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
    """Coordinate-wise (weighted) median, float64 [D]; see ``CoordinateMedian``."""
    out_D = torch.empty(delta_MD.shape[1], dtype=torch.float64, device=delta_MD.device)
    _median_into(out_D, delta_MD, weights)
    return out_D


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
    you know a bound on attackers. Cost: ~3× the mean at M = 8 (``bench/aggregate.py``).
    """

    name = "median"
    coordinatewise = True

    def aggregate(self, delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
        out_D = torch.empty(delta_MD.shape[1], dtype=torch.float32, device=delta_MD.device)
        _median_into(out_D, delta_MD, weights)
        return out_D


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
        m, d = delta_MD.shape
        f, dev = self.f, delta_MD.device
        k = m - 2 * f
        widths = _Widths(m, k, weights is not None, list(range(f, m - f)), dev)
        count = torch.tensor(float(k), dtype=torch.float64, device=dev)  # ``div_``: a true division
        w_M = None if weights is None else torch.tensor(weights, dtype=torch.float64, device=dev)
        out_D = torch.empty(d, dtype=torch.float32, device=dev)
        for s, e in blocks(d, widths.n):
            sc = widths.get(e - s)
            srt = sc.sort(delta_MD[:, s:e])
            kept = srt[f : m - f] if w_M is None else sc.values(srt[f : m - f], "kept")
            plain = sc.buf("plain", 1, torch.float64)[0]
            if w_M is not None:
                w = sc.weights(w_M, srt[f : m - f])
                num = sc.buf("num", k, torch.float64).copy_(kept).mul_(w)  # w · v, float64
                for r in range(1, k):
                    num[0].add_(num[r])
                    w[0].add_(w[r])
                num[0].div_(w[0])
                # Where the kept learners all weigh 0, the unweighted mean (rare: one check per
                # block rather than a ``where`` on every column).
                if bool(w[0].gt(0).all()):
                    out_D[s:e].copy_(num[0])
                    continue
            plain.copy_(kept[0])
            for r in range(1, k):
                plain.add_(kept[r])
            plain.div_(count)
            if w_M is not None:
                torch.where(w[0] > 0, num[0], plain, out=plain)
            out_D[s:e].copy_(plain)
        return out_D
