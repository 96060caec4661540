"""Capped weights: no single participant may hold more than a fixed share of the total.

Used for committee draws (accepted tokens) and for token-weighted merging of deltas, so a peer
that claims, or even honestly has, a huge share cannot dominate either.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping


def capped_weights(raw: Mapping[str, float], cap_fraction: float) -> dict[str, float]:
    """``raw`` with each weight cut to c, where c solves c = f · Σ min(w_i, c).

    This water-filling cap cannot be inflated by the capped peer's own weight (a cap of f times
    the raw total could). Computed by bisection with a fixed number of steps over the mapping
    in its given order, so every node that passes the same mapping gets identical floats.
    Returns ``raw`` unchanged when ``cap_fraction >= 1`` or fewer than two entries exist; with
    n entries, a cap below 1/n is unreachable and every weight ends equal.
    """
    weights = {k: float(v) for k, v in raw.items()}
    if cap_fraction >= 1.0 or len(weights) < 2:
        return weights
    if any(w < 0 for w in weights.values()):
        raise ValueError("weights must be non-negative")
    if cap_fraction * sum(1 for w in weights.values() if w > 0) <= 1.0:
        # No weight can be at most f of the total unless all are equal: give every entry the
        # smallest positive weight (a bisection would converge to all zeros here).
        positive = [w for w in weights.values() if w > 0]
        return {k: min(positive) if positive else 0.0 for k in weights}
    values = list(weights.values())
    lo, hi = 0.0, max(values)
    for _ in range(100):
        mid = (lo + hi) / 2
        total = 0.0  # ``ordered_sum`` of min(w, mid), inlined: 100 passes over every input
        for w in values:
            total += mid if mid < w else w  # exactly min(w, mid), NaN included
        if mid <= cap_fraction * total:
            lo = mid
        else:
            hi = mid
    return {k: min(w, lo) for k, w in weights.items()}


def ordered_sum(values: Iterable[float]) -> float:
    """The protocol's sum of floats: left to right, one IEEE-754 double add at a time.

    Not the builtin ``sum``: from Python 3.12 it compensates (Neumaier), so a 3.11 node and a
    3.12 node would weigh one merge, or draw one committee, differently and never agree on the
    state they sign (ADR 0051). This is what ``sum`` computed before 3.12, on every version.
    """
    total = 0.0
    for v in values:
        total += v
    return total


def merge_weights(entries: Mapping[str, tuple[int, int]], cap_fraction: float) -> dict[str, float]:
    """Merge weights of a round's submissions, the one rule every merge uses.

    ``entries`` maps a submission id to (tokens, lag), lag = certified version − base version.
    A submission weighs tokens / (1 + lag), capped per ``capped_weights`` at ``cap_fraction``
    of the total. The mapping's order is kept, so callers pass ids in sorted order.
    """
    return dict(_merge_weights(tuple(entries.items()), cap_fraction))


@functools.lru_cache(maxsize=8)
def _merge_weights(
    entries: tuple[tuple[str, tuple[int, int]], ...], cap_fraction: float
) -> tuple[tuple[str, float], ...]:
    """Memoized: every member of a committee (and, in the simulator, every simulated one)
    weighs the same input set; the water-filling costs 100 passes over it."""
    raw = {k: float(tokens) / (1 + lag) for k, (tokens, lag) in entries}
    return tuple(capped_weights(raw, cap_fraction).items())


def plausible_claim(steps: int, tokens: int, max_steps: int) -> tuple[int, int]:
    """A submission's (steps, tokens) claim, clipped to what one delta can hold.

    A round's delta covers at most ``max_steps`` inner steps (the manifest's H: the learner
    sends once it has trained H steps from its base, docs/adr/0010-checked-claims.md), so a
    larger steps claim is cut to ``max_steps`` and its tokens scaled by the same ratio (integer
    arithmetic, at least 1): every syncer computes the same clipped claim from the same header,
    and the clipped one is what weighs in the merge and what the certificate credits.
    """
    if max_steps < 1:
        raise ValueError("max_steps must be at least 1")
    if steps <= max_steps:
        return steps, tokens
    return max_steps, max(1, tokens * max_steps // steps)
