"""Clone folding (ADR 0036): near-identical deltas count as one vote in the merge.

Honest learners train on different data, so in the high dimension of a model their deltas are
all about as far from each other as the typical pair. Copies of one vector sent under several
identities (a coalition sending one poisoned vector, inner-product manipulation from every
attacker, a copy of an honest delta) are not: they sit at distance ~0 from each other, and a
coordinate-wise rule counts each copy as a separate learner, so B copies move a trimmed mean
or a median as B attackers can. Folding gives each group of copies one row in the merge.

The rule, on the rows that passed screening: two rows are *clones* when their squared distance
is at most ``factor² ×`` the *spread*: the median, over the trusted rows (all rows when none is
trusted, so probationary rows cannot move it), of each row's median squared distance to the
other rows. With fewer than half the rows attacking, an honest row's median distance is one to
another honest row, so copies far from the honest deltas cannot stretch the spread (the median
over all pairs can: at 3 attackers of 8, most pairs have one attacker in them). Clones are
joined transitively into groups; a group is merged as its first row in input order (with that
row's weight), and every other row of it is *folded* into that one. Every number comes from
``SqSums`` (float64, fixed tree) and the comparisons are on Python floats, so every honest
syncer folds the same rows (ADR 0005).

Cost: M(M − 1)/2 squared distances (``RowSet.pairwise_sq_dists``, as Krum computes them);
time grows as M², memory stays within a quarter of a row (ADR 0036 has the figures).
"""

from __future__ import annotations

from p2pdiloco.aggregate.exact import median_of
from p2pdiloco.aggregate.rows import RowSet


def fold_clones(
    deltas: RowSet, rows: list[int], anchors: list[int], factor: float
) -> dict[int, int]:
    """Each folded row of ``rows`` (positions in ``deltas``, input order) → the row it is
    merged as. ``anchors`` are the trusted ones among ``rows``; ``factor`` ≥ 0."""
    if len(rows) < 2:
        return {}
    dist = deltas.pairwise_sq_dists(rows)
    to_others = [[d for b, d in enumerate(row) if b != a] for a, row in enumerate(dist)]
    held = set(anchors)
    spread = median_of(
        [median_of(to_others[a]) for a, r in enumerate(rows) if r in held]
        or [median_of(v) for v in to_others]
    )
    threshold = factor * factor * spread
    root = list(range(len(rows)))

    def find(a: int) -> int:
        while root[a] != a:
            a = root[a]
        return a

    for a in range(len(rows) - 1):
        for b in range(a + 1, len(rows)):
            if dist[a][b] <= threshold:
                ra, rb = find(a), find(b)
                if ra != rb:
                    root[max(ra, rb)] = min(ra, rb)  # a group's root is its first row
    return {rows[a]: rows[find(a)] for a in range(len(rows)) if find(a) != a}
