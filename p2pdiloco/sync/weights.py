"""Capped weights: no single participant may hold more than a fixed share of the total.

Used for committee draws (accepted tokens) and for token-weighted merging of deltas, so a peer
that claims, or even honestly has, a huge share cannot dominate either.
"""

from __future__ import annotations

from collections.abc import Mapping


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
    lo, hi = 0.0, max(weights.values())
    for _ in range(100):
        mid = (lo + hi) / 2
        if mid <= cap_fraction * sum(min(w, mid) for w in weights.values()):
            lo = mid
        else:
            hi = mid
    return {k: min(w, lo) for k, w in weights.items()}


def merge_weights(entries: Mapping[str, tuple[int, int]], cap_fraction: float) -> dict[str, float]:
    """Merge weights of a round's submissions, the one rule every merge uses.

    ``entries`` maps a submission id to (tokens, lag), lag = certified version − base version.
    A submission weighs tokens / (1 + lag), capped per ``capped_weights`` at ``cap_fraction``
    of the total. The mapping's order is kept, so callers pass ids in sorted order.
    """
    raw = {k: float(tokens) / (1 + lag) for k, (tokens, lag) in entries.items()}
    return capped_weights(raw, cap_fraction)
