"""The deterministic arithmetic every aggregation rule is built from: blocked float64 norms and
distances, ordered row sums, true division.

Shape legend (all modules of this package):
    M  learners (rows), in the order the committee agreed on
    D  parameters of one flattened fragment (columns)
    n  columns of one block
    G  rows of one group of vectors whose norms are computed together
    R  all the vectors whose norms one call computes
    ``delta_MD`` float32 [M, D] learners' pseudo-gradients; ``weights`` M Python floats

Determinism contract. Honest syncers on different machines, SIMD widths and thread counts must
produce bit-identical aggregates, so that their signatures over the state hash match. Every rule
is therefore built from four kinds of operation only:

1. Element-wise ops in torch: casts, ``add_``/``sub_`` with the default alpha of 1, ``mul_``,
   ``div_`` by a tensor (``div_`` below), ``minimum``/``maximum``, comparisons, integer bit ops
   and index gathers. Each output element is one correctly rounded IEEE operation (or an exact
   one) on the same input elements, so it cannot depend on how elements are split across
   threads or SIMD lanes. Never ``add(alpha=c)``, ``addcmul``, ``lerp`` or ``addcdiv``:
   PyTorch's vectorised path computes them with a fused multiply-add and its scalar tail
   without, and the tail boundary moves with the thread split.
2. Sums over the learner axis: an explicit loop over rows in learner order, in float64.
3. Sums over the parameter axis (norms, distances): never ``torch.sum``/``norm``/``dot``, whose
   CPU kernels keep one partial sum per thread and several per SIMD register, so their rounding
   depends on the thread count and the instruction set (measured: ``x.sum()`` of 2M float32
   differs between 1 and 2 threads). Instead ``sq_norms64`` squares in float64 and adds by a
   fixed pairwise tree made of element-wise adds: each ``BLOCK`` of consecutive coordinates is
   folded in halves (``x[:h] += x[n-h:n]`` until one value is left), then the per-block values
   are folded the same way. The tree depends on D and ``BLOCK`` alone, and its error is
   O(log D) ulps. (NumPy's pairwise ``add.reduce`` is thread-independent too, but its blocking
   is an unversioned detail of a NumPy build and it needs a copy out of torch; the fold is ours
   and, on cache-sized blocks, about as fast as ``torch.sum``.)
4. Scalar logic (scores, scale factors, weight sums) in Python floats (IEEE double), with
   ``math.fsum`` (exactly rounded) for sums over learners.

The only torch reductions used are ``aminmax`` in validation (min/max are exact in any order)
and a per-block ``all`` over booleans in the weighted trimmed mean (exact as well).
Per-coordinate order statistics are in ``order.py`` (a comparison network: the same ops).
``BLOCK`` is part of the contract: changing it changes the last bits of norm-based rules.
Tested on CPU (1 vs 2 threads, AVX-512 build); the ops are also chosen to agree on CUDA
(e.g. ``div_``), which has not been tested.

``tests/test_aggregate.py::test_bit_exact_across_thread_counts`` enforces this contract; when a
rule fails it, fix the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

BLOCK = 4096  # fold leaf: coordinates summed by one halving tree before blocks are combined
GRAIN = 32768  # torch's intra-op grain: ops on at most this many elements stay on one thread
assert BLOCK & (BLOCK - 1) == 0 and GRAIN % BLOCK == 0  # SqSums cuts full trees into halves
# Blocked loops keep each op at or below GRAIN elements: in cache, and off the thread pool,
# whose hand-offs cost milliseconds per op on a busy machine (results would not change).


def blocks(numel: int, size: int = BLOCK) -> Iterator[tuple[int, int]]:
    """Consecutive ``(start, end)`` column ranges of at most ``size`` covering ``range(numel)``."""
    for s in range(0, numel, size):
        yield s, min(numel, s + size)


def _row_slices(rows: int, per: int) -> list[slice]:
    return [slice(r, min(rows, r + per)) for r in range(0, rows, per)]


def cols_per_block(rows: int) -> int:
    """Columns per block so that a [rows, n] op stays within ``GRAIN`` elements."""
    return max(64, GRAIN // max(1, rows))


def _fold_(v_Rn: torch.Tensor) -> None:
    """Pairwise-sum each row of ``v_Rn`` into its column 0, in place (halving tree)."""
    n = v_Rn.shape[-1]
    while n > 1:
        h = n // 2
        v_Rn[..., :h].add_(v_Rn[..., n - h : n])
        n -= h


def sq_norms64(
    delta_MD: torch.Tensor,
    rows: Sequence[int] | None = None,
    center_D: torch.Tensor | None = None,
) -> list[float]:
    """Squared L2 norms ``‖delta_MD[i] − center_D‖²`` for ``i`` in ``rows`` (default: all), in
    float64 by the fixed pairwise tree of the module docstring; bit-identical on any machine.

    ``center_D`` may be float32 or float64 (it is not rounded to float32).
    """
    idx = list(range(delta_MD.shape[0])) if rows is None else list(rows)
    return _blocked_sq_sums(delta_MD, [(i, i) for i in idx], center_D)


def pairwise_sq_dists64(delta_MD: torch.Tensor) -> list[list[float]]:
    """Symmetric matrix of ``‖delta_MD[i] − delta_MD[j]‖²`` (float64, same tree as
    ``sq_norms64``); the diagonal is 0."""
    m = delta_MD.shape[0]
    terms = [(i, j) for i in range(m - 1) for j in range(i + 1, m)]
    out = [[0.0] * m for _ in range(m)]
    for (i, j), v in zip(terms, _blocked_sq_sums(delta_MD, terms, None), strict=True):
        out[i][j] = out[j][i] = v
    return out


def _blocked_sq_sums(
    delta_MD: torch.Tensor,
    terms: Sequence[tuple[int, int]],
    center_D: torch.Tensor | None,
) -> list[float]:
    """For each term ``(i, j)`` with j > i: Σ over coordinates of (d_j − d_i)²; with j == i:
    Σ (d_i − center)², or Σ d_i² without a center. Rows are processed in groups that fit one
    ``GRAIN``-sized op; a term's value does not depend on its group."""
    sums = SqSums(terms, delta_MD.shape[1], delta_MD.device)
    sums.add(delta_MD, 0, center_D)
    return sums.result()


class SqSums:
    """The sums of ``_blocked_sq_sums``, fed one column window at a time (``add``), so a caller
    never holds the whole [M, D]: each ``BLOCK`` of coordinates leaves one float64 partial per
    term, and ``result`` folds those. A window must start at a multiple of ``BLOCK`` (then every
    partial, and so every result, is bit-identical to one call on the whole matrix).

    Speed without new bits: the rows are widened to float64 once per ``GRAIN`` columns (then one
    ``sub`` per run of terms, not a copy and a ``sub``), and a full block's halving tree is cut
    after its first ``log2(BLOCK / STAGE)`` levels: the ``STAGE`` values left per term and block
    are staged for all the blocks of those columns and folded together, the same additions in
    the same order in a few ops instead of a dozen per block (ADR 0030)."""

    STAGE = 64  # values per term and block left to the batched end of the halving tree

    def __init__(self, terms: Sequence[tuple[int, int]], numel: int, device: torch.device):
        self.terms, self.numel, self.device = list(terms), numel, device
        r = len(self.terms)
        self.per_group = max(1, GRAIN // BLOCK)
        self.part_RB = torch.zeros(
            r, max(1, -(-numel // BLOCK)), dtype=torch.float64, device=device
        )
        self.buf_Gn = torch.empty(
            self.per_group, min(numel, BLOCK) or 1, dtype=torch.float64, device=device
        )
        self.stage_RKs = torch.empty(
            r, GRAIN // BLOCK, self.STAGE, dtype=torch.float64, device=device
        )
        self.rows = sorted({r for term in self.terms for r in term})
        self.x64: torch.Tensor | None = None  # the window's rows in float64, made on first use
        # Each group is filled by runs of consecutive rows j sharing what is subtracted from them
        # (row i for a pair, else the center): (row in group, i or -1, first j, last j).
        self.groups: list[tuple[int, int, list[tuple[int, int, int, int]]]] = []
        for g0 in range(0, r, self.per_group):
            runs: list[tuple[int, int, int, int]] = []
            for t, (i, j) in enumerate(self.terms[g0 : g0 + self.per_group]):
                base = i if j != i else -1
                if runs and runs[-1][1] == base and runs[-1][3] + 1 == j:
                    runs[-1] = (*runs[-1][:3], j)
                else:
                    runs.append((t, base, j, j))
            self.groups.append((g0, min(r, g0 + self.per_group), runs))

    def add(self, win_Mn: torch.Tensor, start: int, center_n: torch.Tensor | None = None) -> None:
        """Columns ``start : start + n`` of the matrix (rows as the terms index them) and of the
        center, if any."""
        if start % BLOCK:
            raise ValueError(f"a window starts at a multiple of {BLOCK}, not {start}")
        if not self.terms:
            return
        m = win_Mn.shape[0]
        if self.x64 is None or self.x64.shape[0] < m:
            self.x64 = torch.empty(m, GRAIN, dtype=torch.float64, device=self.device)
            self.c64 = torch.empty(GRAIN, dtype=torch.float64, device=self.device)
            self.plans: dict[bool, list[Callable[[], object]]] = {}
        per = GRAIN // BLOCK
        for b0, b1 in blocks(win_Mn.shape[1], GRAIN):
            for r in self.rows:
                self.x64[r, : b1 - b0].copy_(win_Mn[r, b0:b1])
            k0 = (start + b0) // BLOCK
            if b1 - b0 == GRAIN:  # the usual case: ops on views made once (they cost ~1 µs each)
                if center_n is not None:
                    self.c64.copy_(center_n[b0:b1])
                for op in self._plan(center_n is not None):
                    op()
                for rs in _row_slices(len(self.terms), per):
                    self.part_RB[rs, k0 : k0 + per].copy_(self.stage_RKs[rs, :, 0])
                continue
            x64 = self.x64[:, : b1 - b0]
            c = None if center_n is None else center_n[b0:b1]
            for g0, g1, runs in self.groups:
                for kb, (s, e) in enumerate(blocks(b1 - b0), start=k0):
                    v = self._squares(g1 - g0, runs, x64, c, s, e - s)
                    _fold_(v)
                    self.part_RB[g0:g1, kb].copy_(v[:, 0])

    def _plan(self, centered: bool) -> list[Callable[[], object]]:
        """The ops of one full ``GRAIN``-column batch, on fixed views: squares block by block,
        each block's tree down to ``STAGE`` values, then the rest of every tree at once."""
        if centered in self.plans:
            return self.plans[centered]
        assert self.x64 is not None
        x64 = self.x64
        ops: list[Callable[[], object]] = []
        for g0, g1, runs in self.groups:
            v_Gn = self.buf_Gn[: g1 - g0, :BLOCK]
            for kb in range(GRAIN // BLOCK):
                s, e = kb * BLOCK, (kb + 1) * BLOCK
                for t, base, first, last in runs:
                    v, x = v_Gn[t : t + last - first + 1], x64[first : last + 1, s:e]
                    if base >= 0:
                        ops.append(partial(torch.sub, x, x64[base, s:e], out=v))
                    elif centered:
                        ops.append(partial(torch.sub, x, self.c64[s:e], out=v))
                    else:
                        ops.append(partial(v.copy_, x))
                ops.append(partial(v_Gn.mul_, v_Gn))
                n = BLOCK
                while n > 2 * self.STAGE:
                    n //= 2
                    ops.append(partial(v_Gn[:, :n].add_, v_Gn[:, n : 2 * n]))
                out = self.stage_RKs[g0:g1, kb]
                ops.append(
                    partial(torch.add, v_Gn[:, : self.STAGE], v_Gn[:, self.STAGE : n], out=out)
                )
        per_op = max(1, GRAIN // (GRAIN // BLOCK * self.STAGE))
        for rs in _row_slices(len(self.terms), per_op):
            stage = self.stage_RKs[rs]
            n = self.STAGE
            while n > 1:
                n //= 2
                ops.append(partial(stage[..., :n].add_, stage[..., n : 2 * n]))
        self.plans[centered] = ops
        return ops

    def _squares(
        self,
        g: int,
        runs: list[tuple[int, int, int, int]],
        x64_Mn: torch.Tensor,
        center_n: torch.Tensor | None,
        s: int,
        n: int,
    ) -> torch.Tensor:
        """[g, n] float64: each term's squared differences on columns ``s : s + n``."""
        v_Gn = self.buf_Gn[:g, :n]
        for t, base, first, last in runs:
            v, x = v_Gn[t : t + last - first + 1], x64_Mn[first : last + 1, s : s + n]
            if base >= 0:
                torch.sub(x, x64_Mn[base, s : s + n], out=v)
            elif center_n is not None:
                torch.sub(x, center_n[s : s + n], out=v)
            else:
                v.copy_(x)
        return v_Gn.mul_(v_Gn)

    def result(self) -> list[float]:
        if not self.terms:
            return []
        _fold_(self.part_RB)
        return [float(x) for x in self.part_RB[:, 0].tolist()]


def row_sum64(
    delta_MD: torch.Tensor,
    rows: Sequence[int],
    coef: Sequence[float] | None = None,
    center_D: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Σ_{i in rows} coef[i] · (delta_MD[i] − center_D)`` as float64 [D], summed in the order
    of ``rows``; ``coef`` (indexed by learner) and ``center_D`` are optional. Element-wise only.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("row_sum64 needs at least one row")
    m, d = len(rows), delta_MD.shape[1]
    dev = delta_MD.device
    out_D = torch.empty(d, dtype=torch.float64, device=dev)
    plain = coef is None and center_D is None
    contiguous = rows == list(range(rows[0], rows[0] + m))
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    coef_M1 = (
        None
        if coef is None
        else torch.tensor([coef[i] for i in rows], dtype=torch.float64, device=dev).view(m, 1)
    )
    cols = cols_per_block(m)
    buf_Mn = None if plain else torch.empty(m, min(d, cols), dtype=torch.float64, device=dev)
    for s, e in blocks(d, GRAIN if plain else cols):
        acc = out_D[s:e]
        if plain:
            acc.copy_(delta_MD[rows[0], s:e])
            for i in rows[1:]:
                acc.add_(delta_MD[i, s:e])
            continue
        assert buf_Mn is not None
        v_Mn = buf_Mn[:, : e - s]
        if contiguous:
            v_Mn.copy_(delta_MD[rows[0] : rows[0] + m, s:e])
        else:
            v_Mn.copy_(delta_MD[:, s:e].index_select(0, idx))
        if center_D is not None:
            v_Mn.sub_(center_D[s:e])
        if coef_M1 is not None:
            v_Mn.mul_(coef_M1)
        acc.copy_(v_Mn[0])
        for r in range(1, m):
            acc.add_(v_Mn[r])
    return out_D


def div_(x: torch.Tensor, denom: float) -> torch.Tensor:
    """``x / denom`` in place, as a true IEEE division on every device. (CUDA turns division by
    a Python scalar into multiplication by its reciprocal, which rounds differently from the
    CPU; dividing by a 0-dim tensor on ``x``'s device keeps the real division everywhere.)"""
    return x.div_(torch.tensor(denom, dtype=x.dtype, device=x.device))


def median_of(values: Sequence[float]) -> float:
    """Median of Python floats (mean of the two middle ones for an even count)."""
    s = sorted(values)
    if not s:
        raise ValueError("median of an empty list")
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2
