"""Robust aggregation: every rule against an independent NumPy float64 reference, robustness to
sign-flip attackers, screening, validation, and bit-exactness across thread counts."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pdiloco.aggregate import RULES, AggregationRule, clip_norms, get_rule, screen
from p2pdiloco.aggregate.clipping import judge_norms
from p2pdiloco.aggregate.exact import BLOCK, median_of, pairwise_sq_dists64, sq_norms64

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- NumPy references (float64)


def _w(w: np.ndarray | None, m: int) -> np.ndarray:
    return np.ones(m) if w is None else w


def ref_mean(x: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    w = _w(w, len(x))
    return sum(w[i] * x[i] for i in range(len(x))) / w.sum()


def ref_median(x: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Weighted median per coordinate: midpoint of the first value whose cumulative weight
    reaches half and the first that exceeds it (the plain median for equal weights)."""
    m, d = x.shape
    w = _w(w, m)
    half = math.fsum(w.tolist()) / 2
    out = np.empty(d)
    for j in range(d):
        order = np.argsort(x[:, j], kind="stable")
        v, cw = x[order, j], np.cumsum(w[order])
        lo = v[np.argmax(cw >= half)] if (cw >= half).any() else v[-1]
        hi = v[np.argmax(cw > half)] if (cw > half).any() else v[-1]
        out[j] = (lo + hi) / 2
    return out


def ref_trimmed_mean(x: np.ndarray, f: int, w: np.ndarray | None = None) -> np.ndarray:
    m, d = x.shape
    out = np.empty(d)
    for j in range(d):
        kept = np.argsort(x[:, j], kind="stable")[f : m - f]
        vals = x[kept, j]
        if w is None or w[kept].sum() == 0:
            out[j] = vals.mean()
        else:
            out[j] = (w[kept] * vals).sum() / w[kept].sum()
    return out


def ref_krum_ranking(x: np.ndarray, f: int) -> list[int]:
    m = len(x)
    d2 = np.array([[((x[i] - x[j]) ** 2).sum() for j in range(m)] for i in range(m)])
    scores = [np.sort(np.delete(d2[i], i))[: m - f - 2].sum() for i in range(m)]
    return sorted(range(m), key=lambda i: (scores[i], i))


def ref_multi_krum(x: np.ndarray, f: int, m: int | None, w: np.ndarray | None) -> np.ndarray:
    chosen = sorted(ref_krum_ranking(x, f)[: (len(x) - f) if m is None else m])
    ws = None if w is None or w[chosen].sum() == 0 else w[chosen]
    return ref_mean(x[chosen], ws)


def ref_centered_clip(
    x: np.ndarray, tau: float, iters: int, w: np.ndarray | None, relative: bool = False
) -> np.ndarray:
    w = _w(w, len(x))
    v = ref_median(x, w)
    for it in range(iters):
        dist = np.array([np.sqrt(((xi - v) ** 2).sum()) for xi in x])
        if it == 0 and relative:
            tau = tau * float(np.median(dist))
        step = sum(w[i] * (x[i] - v) * min(1.0, tau / max(dist[i], 1e-300)) for i in range(len(x)))
        v = v + step / w.sum()
    return v


def ref_geometric_median(x: np.ndarray, nu: float, iters: int, w: np.ndarray | None) -> np.ndarray:
    w = _w(w, len(x))
    z = ref_median(x, w)
    for _ in range(iters):
        beta = np.array([w[i] / max(nu, np.sqrt(((z - x[i]) ** 2).sum())) for i in range(len(x))])
        z = sum(beta[i] * x[i] for i in range(len(x))) / beta.sum()
    return z


# ---------------------------------------------------------------- rules vs references


def _inputs(seed: int, m: int, d: int, weighted: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen) * torch.rand(m, 1, generator=gen).add(0.5)
    x[:, : d // 10] = torch.randn(1, d // 10, generator=gen)  # equal values across learners
    w = None
    if weighted:
        w = (
            torch.randint(0, 4, (m,), generator=gen).float()
            if seed % 2
            else torch.rand(m, generator=gen) + 0.1
        )
        w[0] = max(float(w[0]), 1.0)  # positive sum
    return x, w


CASES = [
    ("mean", {}, lambda x, w: ref_mean(x, w)),
    ("sender_mean", {}, lambda x, w: ref_mean(x, w)),  # no zeros: everyone sent everything
    ("median", {}, lambda x, w: ref_median(x, w)),
    ("trimmed_mean", {"f": 2}, lambda x, w: ref_trimmed_mean(x, 2, w)),
    ("trimmed_mean", {"f": 0}, lambda x, w: ref_trimmed_mean(x, 0, w)),
    ("multi_krum", {"f": 1}, lambda x, w: ref_multi_krum(x, 1, None, w)),
    ("multi_krum", {"f": 2, "m": 2}, lambda x, w: ref_multi_krum(x, 2, 2, w)),
    ("centered_clip", {"tau": 0.5}, lambda x, w: ref_centered_clip(x, 0.5, 3, w)),
    (
        "centered_clip",
        {"tau": 1.0, "iters": 2, "relative": True},
        lambda x, w: ref_centered_clip(x, 1.0, 2, w, relative=True),
    ),
    ("geometric_median", {}, lambda x, w: ref_geometric_median(x, 1e-6, 8, w)),
    ("geometric_median", {"iters": 2}, lambda x, w: ref_geometric_median(x, 1e-6, 2, w)),
]


@pytest.mark.parametrize("name,params,ref", CASES, ids=[f"{c[0]}{c[1]}" for c in CASES])
@pytest.mark.parametrize("m,d", [(7, 50), (8, 50), (9, 2 * BLOCK + 37)])
@pytest.mark.parametrize("weighted", [False, True])
def test_rule_matches_numpy_reference(name, params, ref, m, d, weighted) -> None:
    for seed in (0, 1) if d < 1000 else (2,):
        x, w = _inputs(seed, m, d, weighted)
        before = x.clone()
        got = get_rule(name, **params)(x, w)
        want = ref(x.double().numpy(), None if w is None else w.double().numpy())
        assert got.dtype == torch.float32 and got.shape == (d,)
        scale = float(x.abs().max())
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6 * scale)
        assert torch.equal(x, before)  # inputs untouched


@pytest.mark.parametrize("m,f", [(7, 1), (8, 2), (9, 2)])
def test_krum_selects_the_reference_delta_exactly(m: int, f: int) -> None:
    for seed in range(3):
        x, w = _inputs(seed, m, 300, weighted=True)
        best = ref_krum_ranking(x.double().numpy(), f)[0]
        assert torch.equal(get_rule("krum", f=f)(x), x[best])
        assert torch.equal(get_rule("krum", f=f)(x, w), x[best])  # weights ignored


def test_equal_weights_give_the_unweighted_result_bit_for_bit() -> None:
    x, _ = _inputs(3, 8, 3000, weighted=False)
    x[2, :100] = -0.0  # signed zeros must not leak into the result differently
    ones = torch.ones(8)
    for name in (
        "mean",
        "sender_mean",
        "median",
        "trimmed_mean",
        "multi_krum",
        "centered_clip",
        "geometric_median",
    ):
        rule = get_rule(name)
        assert torch.equal(rule(x), rule(x, ones)), name


def test_deterministic_norms_match_exact_sums() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3 * BLOCK + 11, generator=gen) * 10
    x64 = x.double().numpy()
    for got, row in zip(sq_norms64(x), x64, strict=True):
        assert got == pytest.approx(math.fsum((row * row).tolist()), rel=1e-13)
    d2 = pairwise_sq_dists64(x)
    diff = (x64[1] - x64[3]).tolist()
    assert d2[1][3] == d2[3][1] == pytest.approx(math.fsum(v * v for v in diff), rel=1e-13)
    center = torch.randn(x.shape[1], generator=gen, dtype=torch.float64)
    got = sq_norms64(x, rows=[2], center_D=center)[0]
    want = math.fsum(((x64[2] - center.numpy()) ** 2).tolist())
    assert got == pytest.approx(want, rel=1e-13)


# ---------------------------------------------------------------- robustness


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float(a64 @ b64 / (a64.norm() * b64.norm()))


def test_robust_rules_survive_two_of_nine_sign_flippers() -> None:
    gen = torch.Generator().manual_seed(11)
    mu = torch.randn(200, generator=gen)
    honest = mu + 0.5 * torch.randn(7, 200, generator=gen)
    x = torch.cat([honest[:2], -100 * honest[:1], honest[2:6], -100 * honest[1:2], honest[6:]])
    target = honest.mean(0)
    for name, params in [
        ("median", {}),
        ("trimmed_mean", {"f": 2}),
        ("krum", {"f": 2}),
        ("multi_krum", {"f": 2}),
        ("centered_clip", {}),
        ("geometric_median", {}),
    ]:
        assert _cos(get_rule(name, **params)(x), target) > 0.9, name
    assert _cos(get_rule("mean")(x), target) < 0


# ---------------------------------------------------------------- screening and clipping


def test_screen_rejects_malformed_and_oversized_deltas() -> None:
    gen = torch.Generator().manual_seed(4)
    rows: list[torch.Tensor] = [torch.randn(1000, generator=gen) for _ in range(6)]
    rows[1] = rows[1].clone()
    rows[1][17] = float("nan")
    rows[2] = torch.randn(999, generator=gen)
    rows[4] = rows[4] * 50
    rows.append(torch.ones(1000, dtype=torch.int64))
    rows.append(torch.full((1000,), float("inf")))
    res = screen(rows, expected_numel=1000)
    assert res.accepted == [0, 3, 5]
    assert res.rejected[1] == "non-finite values"
    assert res.rejected[7] == "non-finite values"
    assert "numel 999" in res.rejected[2]
    assert res.rejected[4].startswith("norm ") and "3.0 × median" in res.rejected[4]
    assert "not floating point" in res.rejected[6]
    assert res.norms[0] == pytest.approx(float(rows[0].double().norm()), rel=1e-12)
    # Inferred size (majority), a 2-D tensor input, and the norm check switched off.
    assert screen(torch.stack([rows[i] for i in (0, 3, 4, 5)])).accepted == [0, 1, 3]
    assert screen(rows[:1] + rows[3:6], norm_factor=None).accepted == [0, 1, 2, 3]
    assert screen([]).accepted == []


def test_leave_one_out_verdicts_equal_a_median_of_the_others_taken_per_delta() -> None:
    """The O(1) leave-one-out median is the very float ``median_of`` gives on the others'
    norms, with ties, odd and even counts, and trusted reference rows (ADR 0027)."""
    gen = np.random.default_rng(7)
    for trial in range(300):
        m = int(gen.integers(1, 12))
        norms = [float(x) for x in gen.choice([1.0, 1.5, 2.0, 3.0, 4.5, 7.0], size=m)]
        reference = sorted(gen.choice(m, size=int(gen.integers(0, m + 1)), replace=False))
        got = judge_norms(m, {i: n * n for i, n in enumerate(norms)}, {}, 3.0, reference)
        pool = list(reference) or list(range(m))
        want = {}
        for i, n in enumerate(norms):
            others = [norms[j] for j in pool if j != i]
            if others and n > 3.0 * (med := median_of(others)):
                want[i] = f"norm {n:.4g} > 3.0 × median {med:.4g}"
        assert got.rejected == want, (trial, norms, reference)


def test_clip_norms_scales_only_long_rows() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 4000, generator=gen) * torch.tensor([[0.1], [1.0], [3.0], [0.2], [10.0]])
    out = clip_norms(x, 20.0)
    norms = out.double().norm(dim=1)
    assert float(norms.max()) <= 20.0 * (1 + 1e-6)
    for i in range(5):
        if float(x[i].double().norm()) <= 20.0:
            assert torch.equal(out[i], x[i])
        else:
            assert _cos(out[i], x[i]) > 1 - 1e-9 and float(norms[i]) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_norms(x, 0.0)


# ---------------------------------------------------------------- validation


def test_get_rule_builds_every_rule_and_rejects_unknowns() -> None:
    x = torch.randn(7, 10)
    for name in RULES:
        rule = get_rule(name)
        assert isinstance(rule, AggregationRule) and rule.name == name
        assert get_rule(name, **rule.params()).params() == rule.params()
        assert rule(x).shape == (10,)
    assert get_rule("trimmed_mean", f=2.0).params() == {"f": 2}  # CLI numbers are floats
    with pytest.raises(ValueError, match="unknown aggregation rule"):
        get_rule("average")
    with pytest.raises(ValueError, match="takes"):
        get_rule("krum", g=1)
    with pytest.raises(ValueError, match="no parameters"):
        get_rule("mean", f=1)


@pytest.mark.parametrize(
    "name,params,match",
    [
        ("trimmed_mean", {"f": -1}, "f must be"),
        ("trimmed_mean", {"f": 1.5}, "f must be"),
        ("krum", {"f": True}, "f must be"),
        ("multi_krum", {"m": 0}, "m must be"),
        ("centered_clip", {"tau": 0.0}, "tau"),
        ("centered_clip", {"tau": float("inf")}, "tau"),
        ("centered_clip", {"iters": 0}, "iters"),
        ("geometric_median", {"nu": -1.0}, "nu"),
    ],
)
def test_bad_hyperparameters_raise(name: str, params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_rule(name, **params)


@pytest.mark.parametrize(
    "deltas,weights,match",
    [
        (torch.zeros(5), None, "2-D"),
        (torch.zeros(2, 3, 4), None, "2-D"),
        (torch.zeros(0, 4), None, "at least one learner"),
        (torch.zeros(3, 4, dtype=torch.int32), None, "floating point"),
        ([[1.0, 2.0]], None, "torch.Tensor"),
        (torch.tensor([[1.0, float("nan")], [1.0, 2.0]]), None, r"non-finite .*\[0\]"),
        (torch.tensor([[1.0, 2.0], [float("-inf"), 2.0]]), None, r"non-finite .*\[1\]"),
        (torch.zeros(3, 4), torch.ones(2), "shape"),
        (torch.zeros(3, 4), torch.tensor([1.0, -1.0, 1.0]), "non-negative"),
        (torch.zeros(3, 4), torch.tensor([1.0, float("nan"), 1.0]), "finite"),
        (torch.zeros(3, 4), torch.zeros(3), "positive sum"),
    ],
)
def test_bad_inputs_raise_clear_errors(deltas, weights, match) -> None:
    for name in RULES:
        with pytest.raises(ValueError, match=match):
            get_rule(name)(deltas, weights)


@pytest.mark.parametrize(
    "name,params,m",
    [("trimmed_mean", {"f": 2}, 4), ("krum", {"f": 2}, 6), ("multi_krum", {"f": 1, "m": 6}, 5)],
)
def test_too_few_learners_for_f_raise(name: str, params: dict, m: int) -> None:
    rule = get_rule(name, **params)
    with pytest.raises(ValueError, match="needs at least"):
        rule(torch.randn(m, 8))
    rule(torch.randn(rule.min_learners, 8))


# ---------------------------------------------------------------- bit-exactness

_HASHES = r"""
import hashlib, sys
import torch
from p2pdiloco.aggregate import clip_norms, get_rule, screen

def compute():
    gen = torch.Generator().manual_seed(1234)
    M, D = 8, 2_000_000
    x = torch.randn(M, D, generator=gen)
    x.mul_(torch.tensor([1.0, 0.5, 2.0, 1.0, 0.1, 1.5, 1.0, 0.7]).view(M, 1))
    x[5] = -20 * x[0]                 # a scaled sign-flipper
    x[2, :100_000] = -0.0             # signed zeros and ties
    x[3, :100_000] = 0.0
    x[4, 100_000:200_000] = x[1, 100_000:200_000]
    w = torch.tensor([1.0, 2.0, 3.0, 1.0, 1.0, 2.0, 5.0, 0.5])
    digest = lambda t: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
    out = {"input": digest(x)}
    cases = [
        ("mean", {}, None), ("mean", {}, w),
        ("sender_mean", {}, None), ("sender_mean", {}, w),
        ("median", {}, None), ("median", {}, w),
        ("trimmed_mean", {"f": 2}, None), ("trimmed_mean", {"f": 2}, w),
        ("krum", {"f": 2}, None),
        ("multi_krum", {"f": 2}, None), ("multi_krum", {"f": 2}, w),
        ("centered_clip", {}, None), ("centered_clip", {"relative": True}, w),
        ("geometric_median", {}, None),
    ]
    for name, params, weights in cases:
        key = f"{name}{params}{'' if weights is None else ' weighted'}"
        out[key] = digest(get_rule(name, **params)(x, weights))
    out["screen"] = repr(screen(x, expected_numel=D).norms)
    out["clip_norms"] = digest(clip_norms(x, 1000.0))
    return out

if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[1]))
    import json
    print(json.dumps({"threads": torch.get_num_threads(), "hashes": compute()}))
"""


def test_bit_exact_across_thread_counts() -> None:
    """Two fresh interpreters (1 and 2 intra-op threads) and this one hash every rule's output
    on the same 8 × 2M input identically. The most important test here: fix a failing rule."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    procs = {
        n: subprocess.Popen(
            [sys.executable, "-c", _HASHES, str(n)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (1, 2)
    }
    namespace: dict[str, object] = {"__name__": "hashes"}
    exec(_HASHES, namespace)
    here = namespace["compute"]()  # type: ignore[operator]
    results = {}
    for n, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr
        results[n] = json.loads(stdout)
        assert results[n]["threads"] == n
    assert results[1]["hashes"]["input"] == results[2]["hashes"]["input"] == here["input"]
    for key in here:
        assert results[1]["hashes"][key] == results[2]["hashes"][key] == here[key], key
    assert len(set(here.values())) == len(here)  # every case really computed something else
    assert hashlib.sha256(b"").hexdigest() not in here.values()
