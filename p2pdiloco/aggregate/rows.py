"""M deltas as the rows of a virtual float32 [M, D] matrix that is never stacked whole.

A syncer holds the M decoded deltas of a round anyway (one fragment each); stacking them into
one [M, D] tensor (and again for screening) doubled or tripled that: for 8 learners of a 12B
model, hundreds of GB. ``RowSet`` hands out column windows instead: ``window(rows, s, e)`` is a
fresh float32 [len(rows), e − s] copy of those columns, assembled from the rows' own tensors
(in the order given, flattened). Norms are summed window by window (``SqSums``) and the
coordinate-wise rules run window by window; both are bit-identical to a pass over the whole
matrix, since windows start at multiples of ``BLOCK`` and the rules are element-wise per column
(``tests/test_streaming_merge.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import torch

from .exact import GRAIN, SqSums, blocks

# Columns per window: GRAIN (32,768; 1 MiB of float32 at M = 8), a multiple of BLOCK. A row's
# copy into a window is then one op of at most GRAIN elements, which torch keeps on the calling
# thread: on a busy machine every op handed to the thread pool waits milliseconds for its
# second thread (a merge of thousands of such ops stalled committees for minutes in CI).
WINDOW = GRAIN
PAIRS_PER_PASS = 512  # pairwise distances summed per pass over the windows (× 1/2048 of a row)


class RowSet:
    """``rows[i]`` is learner i's delta as a sequence of tensors (any shapes, the same sizes in
    every row), read as one flattened row. Nothing is copied until a window is asked for."""

    def __init__(self, rows: Sequence[Sequence[torch.Tensor]]) -> None:
        if not rows:
            raise ValueError("a RowSet needs at least one row")
        self.rows = [[t.detach().reshape(-1) for t in row] for row in rows]
        sizes = [t.numel() for t in self.rows[0]]
        if any([t.numel() for t in row] != sizes for row in self.rows):
            raise ValueError("every row of a RowSet holds tensors of the same sizes")
        self.starts = [0]
        for n in sizes:
            self.starts.append(self.starts[-1] + n)
        self.m, self.d = len(self.rows), self.starts[-1]
        self.device = self.rows[0][0].device if sizes else torch.device("cpu")

    def spans(self, s: int, e: int) -> Iterator[tuple[int, int, int]]:
        """``(tensor index, first, last)``: the parts of tensors covering columns ``s:e``."""
        k = bisect.bisect_right(self.starts, s) - 1
        while s < e:
            first = s - self.starts[k]
            last = min(e, self.starts[k + 1]) - self.starts[k]
            if last > first:
                yield k, first, last
            s += last - first
            k += 1

    def window(self, rows: Sequence[int], s: int, e: int) -> torch.Tensor:
        """Columns ``s:e`` of ``rows`` (in that order): float32 [len(rows), e − s]."""
        out = torch.empty(len(rows), e - s, dtype=torch.float32, device=self.device)
        col = 0
        for k, first, last in self.spans(s, e):
            for r, i in enumerate(rows):
                out[r, col : col + last - first].copy_(self.rows[i][k][first:last])
            col += last - first
        return out

    def windows(self, size: int = WINDOW) -> Iterator[tuple[int, int]]:
        return blocks(self.d, size)

    def sq_norms(self, rows: Sequence[int]) -> list[float]:
        """``sq_norms64`` of ``rows``, window by window (bit-identical to the stacked call)."""
        sums = SqSums([(t, t) for t in range(len(rows))], self.d, self.device)
        for s, e in self.windows():
            sums.add(self.window(rows, s, e), s)
        return sums.result()

    def pairwise_sq_dists(self, rows: Sequence[int]) -> list[list[float]]:
        """Squared distances between ``rows``, as a [len(rows)]² list (``pairwise_sq_dists64``
        window by window, bit-identical). Their float64 partials (1/2048 of a row per pair) are
        summed ``PAIRS_PER_PASS`` pairs per pass over the windows, so they stay within a quarter
        of a row whatever M (32,640 pairs at M = 256 would hold 16 rows at once)."""
        m = len(rows)
        pairs = [(a, b) for a in range(m - 1) for b in range(a + 1, m)]
        dist = [[0.0] * m for _ in range(m)]
        for c in range(0, len(pairs), PAIRS_PER_PASS):
            chunk = pairs[c : c + PAIRS_PER_PASS]
            sums = SqSums(chunk, self.d, self.device)
            for s, e in self.windows():
                sums.add(self.window(rows, s, e), s)
            for (a, b), v in zip(chunk, sums.result(), strict=True):
                dist[a][b] = dist[b][a] = v
        return dist
