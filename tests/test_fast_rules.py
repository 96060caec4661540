"""The fast robust rules (ADR 0030) give the bits of the straightforward algorithms they replaced:
an odd-even transposition sort per block of columns for the median and the trimmed mean, and a
halving tree per block, op by op, for norms and pairwise distances (Krum). The references below
are those algorithms, kept here as the definition of the certified bytes.

Shapes as in ``p2pdiloco/aggregate/base.py``: ``x_MD`` M learners × D parameters.
"""

from __future__ import annotations

import math

import pytest
import torch

from p2pdiloco.aggregate import get_rule
from p2pdiloco.aggregate.exact import BLOCK, GRAIN, pairwise_sq_dists64, sq_norms64
from p2pdiloco.aggregate.network import batcher_layers
from p2pdiloco.aggregate.order import median64

# ---------------------------------------------------------------- references (the old code)


def _sort_(v_Mn: torch.Tensor) -> None:
    m = v_Mn.shape[0]
    for rnd in range(m):
        p = rnd % 2
        if p + 1 < m:
            a, b = v_Mn[p : m - 1 : 2], v_Mn[p + 1 : m : 2]
            lo, hi = torch.minimum(a, b), torch.maximum(a, b)
            a.copy_(lo)
            b.copy_(hi)


def _flip(bits: torch.Tensor) -> torch.Tensor:
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _sorted(x_Mn: torch.Tensor, w: list[float] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    v = x_Mn + 0.0
    if w is None:
        _sort_(v)
        return v, None
    m = v.shape[0]
    key = (_flip(v.view(torch.int32)).to(torch.int64) << 32) | torch.arange(m).view(m, 1)
    _sort_(key)
    vals = _flip((key >> 32).to(torch.int32)).view(torch.float32)
    return vals, torch.tensor(w, dtype=torch.float64)[key & 0xFFFFFFFF]


def ref_median64(x_MD: torch.Tensor, w: list[float] | None) -> torch.Tensor:
    m = x_MD.shape[0]
    v, cw = _sorted(x_MD, w)
    if cw is None:
        return (v[(m - 1) // 2].double() + v[m // 2]) * 0.5
    for k in range(1, m):
        cw[k] += cw[k - 1]
    half = math.fsum(w or []) / 2
    lo = (cw < half).sum(0, keepdim=True).clamp(max=m - 1)
    hi = (cw <= half).sum(0, keepdim=True).clamp(max=m - 1)
    return (v.gather(0, lo)[0].double() + v.gather(0, hi)[0]) * 0.5


def ref_trimmed_mean(x_MD: torch.Tensor, f: int, w: list[float] | None) -> torch.Tensor:
    m = x_MD.shape[0]
    v, ws = _sorted(x_MD, w)
    plain = v[f].double()
    for k in range(f + 1, m - f):
        plain += v[k]
    plain /= torch.tensor(float(m - 2 * f), dtype=torch.float64)
    if ws is None:
        return plain.float()
    num, den = ws[f] * v[f], ws[f].clone()
    for k in range(f + 1, m - f):
        num += ws[k] * v[k]
        den += ws[k]
    return torch.where(den > 0, num / den, plain).float()


def ref_sq_sums(x_MD: torch.Tensor, terms: list[tuple[int, int]], center: torch.Tensor | None):
    d = x_MD.shape[1]
    part = torch.zeros(len(terms), -(-d // BLOCK), dtype=torch.float64)
    for k, s in enumerate(range(0, d, BLOCK)):
        e = min(d, s + BLOCK)
        for t, (i, j) in enumerate(terms):
            v = x_MD[j, s:e].double()
            if i != j:
                v -= x_MD[i, s:e]
            elif center is not None:
                v -= center[s:e]
            v *= v
            n = e - s
            while n > 1:
                h = n // 2
                v[:h] += v[n - h : n].clone()
                n -= h
            part[t, k] = v[0]
    n = part.shape[1]
    while n > 1:
        h = n // 2
        part[:, :h] += part[:, n - h : n].clone()
        n -= h
    return part[:, 0].tolist()


# ---------------------------------------------------------------- inputs


def _case(seed: int, m: int, d: int) -> tuple[torch.Tensor, dict[str, list[float] | None]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g) * torch.rand(m, 1, generator=g).add(0.5)
    x[:, : d // 3] = (x[:, : d // 3] * 2).round() / 2  # many ties
    x[0, : d // 5] = -0.0
    x[-1, d // 5 : d // 4] = 0.0
    if m > 2:
        x[m // 2, d // 2 :] = x[1, d // 2 :]
    ints = torch.randint(0, 4, (m,), generator=g).double()
    ints[0] = max(1.0, float(ints[0]))
    return x, {
        "none": None,
        "integers with zeros": ints.tolist(),
        "reals": (torch.rand(m, generator=g, dtype=torch.float64) + 0.1).tolist(),
    }


SIZES = [(m, 300) for m in (1, 2, 3, 4, 5, 6, 7, 9, 12, 16, 17)] + [(8, 2 * GRAIN + BLOCK + 37)]


@pytest.mark.parametrize("m,d", SIZES)
def test_median_and_trimmed_mean_keep_the_bits_of_the_transposition_sort(m: int, d: int) -> None:
    x, weights = _case(m * 7 + d, m, d)
    for name, w in weights.items():
        w64 = None if w is None else torch.tensor(w, dtype=torch.float64)  # a list → float32
        assert torch.equal(median64(x, w), ref_median64(x, w)), name
        assert torch.equal(get_rule("median")(x, w64), ref_median64(x, w).float()), name
        for f in range((m - 1) // 2 + 1):
            got = get_rule("trimmed_mean", f=f)(x, w64)
            assert torch.equal(got, ref_trimmed_mean(x, f, w)), (name, f)


@pytest.mark.parametrize("m,d", [(3, 5), (8, 2 * GRAIN + BLOCK + 37), (11, GRAIN)])
def test_norms_and_distances_keep_the_bits_of_the_per_block_tree(m: int, d: int) -> None:
    x, _ = _case(m + d, m, d)
    pairs = [(i, j) for i in range(m - 1) for j in range(i + 1, m)]
    want = ref_sq_sums(x, pairs, None)
    got = pairwise_sq_dists64(x)
    assert [got[i][j] for i, j in pairs] == want
    center = x.double().mean(0)
    diag = [(i, i) for i in range(m)]
    assert sq_norms64(x) == ref_sq_sums(x, diag, None)
    assert sq_norms64(x, center_D=center) == ref_sq_sums(x, diag, center)
    assert sq_norms64(x, center_D=center.float()) == ref_sq_sums(x, diag, center.float())


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16, 33])
def test_batcher_layers_sort_every_zero_one_input(m: int) -> None:
    # The 0-1 principle: a comparator network that sorts every 0-1 input sorts every input.
    layers = batcher_layers(m)
    for bits in range(min(1 << m, 1 << 12)):
        v = [(bits >> i) & 1 for i in range(m)] if m <= 12 else _bits(bits, m)
        for layer in layers:
            assert len({r for pair in layer for r in pair}) == 2 * len(layer)
            for a, b in layer:
                v[a], v[b] = min(v[a], v[b]), max(v[a], v[b])
        assert v == sorted(v)


def _bits(seed: int, m: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (m,), generator=g).tolist()
