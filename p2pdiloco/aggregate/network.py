"""Sorting networks over the learner axis, on column blocks, with every view built once.

Shapes as in ``exact.py``; here ``buf_Mn`` is one block of n columns of M learners' values.

A comparison network sorts each column with element-wise ``minimum``/``maximum`` only, so its
output is bit-exact anywhere (ADR 0005); which comparators run does not change the sorted
values (distinct keys, or equal values that are equal bit patterns). This module uses Batcher's
odd-even merge sort (Knuth 5.3.4): for M = 8, 19 comparators in 6 layers (odd-even
transposition: 28 in 8), padded to a power of two (a pad is +inf and never moves, so its
comparators are dropped). Comparators whose outputs the caller never reads are pruned (the
median reads one or two rows). Each layer's comparators form a few arithmetic progressions of
rows, one ``minimum`` and one ``maximum`` each, written from one buffer into another (ping-pong;
rows a layer leaves alone are copied). The views are made once per ``Sorter``: made per op,
they cost more than the op itself (~1 µs each). No op exceeds ``GRAIN`` elements, so none goes
to torch's thread pool (ADR 0023). ADR 0030 has the measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from .exact import GRAIN

Pair = tuple[int, int]


def batcher_layers(m: int) -> list[list[Pair]]:
    """Layers of comparators ``(i, j)``, i < j (min to i), that sort ``m`` rows ascending."""
    size = 1
    while size < m:
        size *= 2
    layers: list[list[Pair]] = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            layer = []
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    a, b = i + j, i + j + k
                    if a // (2 * p) == b // (2 * p) and b < m:
                        layer.append((a, b))
            if layer:
                layers.append(layer)
            k //= 2
        p *= 2
    return layers


def pruned(layers: list[list[Pair]], wanted: Sequence[int]) -> list[tuple[list[Pair], list[int]]]:
    """Per layer, the comparators that influence the ``wanted`` output rows and the rows to copy
    through unchanged; a row nobody reads later is neither compared nor copied."""
    need = set(wanted)
    out: list[tuple[list[Pair], list[int]]] = []
    for layer in reversed(layers):
        kept = [(a, b) for a, b in layer if a in need or b in need]
        touched = {r for pair in kept for r in pair}
        out.append((kept, sorted(need - touched)))
        need |= touched
    return out[::-1]


def runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """Ascending ``rows`` as arithmetic progressions ``(first, step, count)``."""
    out: list[tuple[int, int, int]] = []
    for r in rows:
        if out and out[-1][2] == 1:
            out[-1] = (out[-1][0], r - out[-1][0], 2)
        elif out and r == out[-1][0] + out[-1][1] * out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((r, 1, 1))
    return out


def _rows(t: torch.Tensor, first: int, step: int, count: int) -> torch.Tensor:
    return t[first : first + step * (count - 1) + 1 : step]


def row_chunks(m: int, n: int) -> list[slice]:
    """Row slices of a [m, n] block with at most ``GRAIN`` elements each."""
    per = max(1, GRAIN // max(1, n))
    return [slice(r, min(m, r + per)) for r in range(0, m, per)]


class Sorter:
    """Sorts the columns of one [m, n] block: ``load`` (or fill ``src`` yourself), ``run``,
    then read the ``wanted`` rows of the buffer ``run`` returns (other rows: garbage)."""

    def __init__(
        self, m: int, n: int, dtype: torch.dtype, device: torch.device, wanted: Sequence[int]
    ):
        self.bufs = (
            torch.empty(m, n, dtype=dtype, device=device),
            torch.empty(m, n, dtype=dtype, device=device),
        )
        self.src = self.bufs[0]
        self.chunks = row_chunks(m, n)
        self.ops: list[Callable[[], object]] = []
        cur = 0
        for comparators, through in pruned(batcher_layers(m), wanted):
            if not comparators:
                continue
            s, t = self.bufs[cur], self.bufs[1 - cur]
            by_gap: dict[int, list[int]] = {}
            for a, b in comparators:
                by_gap.setdefault(b - a, []).append(a)
            for gap, firsts in sorted(by_gap.items()):
                for first, step, count in runs(sorted(firsts)):
                    lo = _rows(s, first, step, count)
                    hi = _rows(s, first + gap, step, count)
                    self._ops(lo, hi, _rows(t, first, step, count), torch.minimum)
                    self._ops(lo, hi, _rows(t, first + gap, step, count), torch.maximum)
            for first, step, count in runs(through):
                src, dst = _rows(s, first, step, count), _rows(t, first, step, count)
                self.ops.append(partial(dst.copy_, src))
            cur = 1 - cur
        self.out = self.bufs[cur]

    def _ops(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, fn: Callable) -> None:
        for rs in row_chunks(a.shape[0], a.shape[1]):
            self.ops.append(partial(fn, a[rs], b[rs], out=out[rs]))

    def load(self, block_Mn: torch.Tensor) -> None:
        """Copy ``block_Mn`` into ``src`` with −0.0 made +0.0 (``x + 0.0``), so that equal values
        are equal bit patterns."""
        for rs in self.chunks:
            torch.add(block_Mn[rs], 0.0, out=self.src[rs])

    def run(self) -> torch.Tensor:
        for op in self.ops:
            op()
        return self.out
