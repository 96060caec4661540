"""capped_weights against an exact sort-based water-filling reference on random inputs."""

from __future__ import annotations

import math
import random

import pytest

from p2pdiloco.core.trust import cap_probation
from p2pdiloco.core.weights import capped_weights, ordered_sum


def _reference_cap(weights: list[float], f: float) -> float:
    """The largest c with c = f · Σ min(w_i, c), solved exactly; inf when nothing is capped.

    With the k largest weights capped, c = f · (sum of the others) / (1 − k·f); the right k is
    the one whose c lies between the (k+1)-th and the k-th largest weight.
    """
    ws = sorted(weights, reverse=True)
    if ws[0] <= f * sum(ws):
        return math.inf
    for k in range(1, len(ws)):
        c = f * sum(ws[k:]) / (1.0 - k * f)
        if ws[k] <= c <= ws[k - 1]:
            return c
    raise AssertionError("no water level found")  # unreachable when f·n > 1


def _random_case(rng: random.Random) -> tuple[dict[str, float], float]:
    n = rng.randint(2, 12)
    kind = rng.choice(["uniform", "skewed", "one_whale"])
    if kind == "uniform":
        ws = [rng.uniform(0.1, 10.0) for _ in range(n)]
    elif kind == "skewed":
        ws = [10 ** rng.uniform(0, 6) for _ in range(n)]
    else:
        ws = [rng.uniform(1, 2) for _ in range(n - 1)] + [rng.uniform(1e3, 1e6)]
    rng.shuffle(ws)
    f = rng.uniform(1.0 / n + 1e-3, 0.99)  # reachable: f · n > 1
    return {f"peer{i}": w for i, w in enumerate(ws)}, f


@pytest.mark.parametrize("seed", range(40))
def test_matches_reference_when_cap_reachable(seed: int) -> None:
    raw, f = _random_case(random.Random(seed))
    capped = capped_weights(raw, f)
    assert list(capped) == list(raw)
    total = sum(capped.values())
    assert max(capped.values()) <= f * total + 1e-9
    # With no cap binding, the bisection ends within an ulp of the largest weight.
    c = min(_reference_cap(list(raw.values()), f), max(raw.values()))
    for k, w in raw.items():
        if w < c * (1 - 1e-9):
            assert capped[k] == w, (k, w, capped[k], c)
        else:
            assert capped[k] == pytest.approx(c, rel=1e-9)


def test_random_cases_exercise_the_cap() -> None:
    capped_cases = sum(
        math.isfinite(_reference_cap(list(raw.values()), f))
        for raw, f in (_random_case(random.Random(seed)) for seed in range(40))
    )
    assert 10 <= capped_cases <= 35


def test_no_cap_needed_leaves_weights_alone() -> None:
    raw = {"a": 1.0, "b": 2.0, "c": 3.0}
    assert capped_weights(raw, 0.6) == raw


def test_whale_is_cut_to_the_fraction_of_the_capped_total() -> None:
    capped = capped_weights({"a": 1.0, "b": 1.0, "c": 1.0, "whale": 1000.0}, 0.4)
    # c = 0.4 · (3 + c)  →  c = 2
    assert capped["whale"] == pytest.approx(2.0, rel=1e-12)
    assert [capped[k] for k in "abc"] == [1.0, 1.0, 1.0]


def test_order_and_determinism() -> None:
    raw, f = _random_case(random.Random(123))
    assert capped_weights(raw, f) == capped_weights(dict(raw), f)


@pytest.mark.parametrize(
    ("raw", "f"),
    [
        ({"a": 1.0, "b": 5.0}, 0.5),
        ({"a": 3.0, "b": 1.0, "c": 2.0}, 0.2),
        ({"a": 1e6, "b": 1.0, "c": 7.0, "d": 0.5}, 0.25),
    ],
)
def test_unreachable_cap_gives_equal_positive_weights(raw: dict[str, float], f: float) -> None:
    assert f * len(raw) <= 1.0
    capped = capped_weights(raw, f)
    values = set(capped.values())
    assert len(values) == 1
    assert values.pop() > 0


def test_trivial_cases_pass_through() -> None:
    assert capped_weights({"a": 5.0}, 0.1) == {"a": 5.0}
    assert capped_weights({"a": 5.0, "b": 1.0}, 1.0) == {"a": 5.0, "b": 1.0}
    with pytest.raises(ValueError):
        capped_weights({"a": -1.0, "b": 1.0}, 0.6)


def test_zero_entries_do_not_zero_everything() -> None:
    # f · n = 1.2 > 1, but only two weights are positive and f · 2 = 0.8 <= 1.
    capped = capped_weights({"a": 1.0, "b": 1.0, "c": 0.0}, 0.4)
    assert capped["a"] == capped["b"] > 0


def test_sums_are_the_protocols_not_the_interpreters() -> None:
    """Python 3.12's ``sum`` compensates (Neumaier); the protocol adds left to right, so a
    3.11 node and a 3.12 node draw and weigh alike (ADR 0051). This case came out one ulp
    apart between the two before: 3.12 capped at 0x1.1cd6aaaaaaaacp+16."""
    assert ordered_sum([1e16, 1.0, 1.0]) == 1e16  # compensated: 1.0000000000000002e16
    rng = random.Random(174)
    n = rng.randint(3, 300)
    raw = {f"p{i}": float(rng.randint(1, 10**6)) / (1 + rng.randint(0, 3)) for i in range(n)}
    capped = capped_weights(raw, 0.25)
    assert max(capped.values()).hex() == "0x1.1cd6aaaaaaaadp+16"
    assert sum(capped[k] != raw[k] for k in raw) == 3
    low = frozenset(list(raw)[:2])
    scaled = cap_probation(capped, low, 0.1)
    share = ordered_sum(scaled[k] for k in low) / ordered_sum(scaled.values())
    assert share == pytest.approx(0.1, rel=1e-12)
