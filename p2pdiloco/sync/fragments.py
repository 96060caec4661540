"""Streaming DiLoCo fragments on the network: which tensors each round syncs (ADR 0032).

The manifest's ``outer.fragments`` = P splits the model's tensors into P balanced fragments
(``train.outer.partition_fragments`` over the tensors in sorted-name order, so every node gets
the same plan from the same shapes). The round on certified version v syncs fragment
``v mod P`` and only that one: learners send that fragment's delta, the round's committee
(elected from the beacon of v, so each fragment's round has its own committee) screens and
merges it, steps that fragment's parameters and momentum, and certifies the whole new state,
whose other fragments are those of v unchanged. Rounds come P times as often as with one
fragment, each learner sends a fragment every H/P inner steps, and each fragment is synced once
every P rounds, that is every H steps, at points staggered H/P apart: Streaming DiLoCo's
schedule (Douillard et al., 2025), in the order ``harness.simulate`` already runs it.

P = 1 is plain DiLoCo: every round syncs fragment 0, the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

from p2pdiloco.train.outer import partition_fragments


def round_fragment(base_version: int, fragments: int) -> int:
    """The fragment the round on ``base_version`` syncs (and version ``base_version + 1``
    updates)."""
    return base_version % max(1, fragments)


def fragment_plan(shapes: Mapping[str, tuple[int, ...]], fragments: int) -> list[list[str]]:
    """The tensor names of each fragment, each list sorted; ValueError if ``fragments`` is
    below 1 or above the number of tensors (a fragment must not be empty)."""
    key = tuple((n, tuple(shapes[n])) for n in sorted(shapes))
    return [list(names) for names in _plan(key, fragments)]


@lru_cache(maxsize=16)
def _plan(
    key: tuple[tuple[str, tuple[int, ...]], ...], fragments: int
) -> tuple[tuple[str, ...], ...]:
    sizes = {n: math.prod(s) for n, s in key}
    return tuple(tuple(sorted(m)) for m in partition_fragments(sizes, fragments))


def round_names(
    shapes: Mapping[str, tuple[int, ...]], fragments: int, base_version: int
) -> list[str]:
    """The tensor names the round on ``base_version`` syncs (all of them when P = 1)."""
    if fragments <= 1:
        return sorted(shapes)
    return fragment_plan(shapes, fragments)[round_fragment(base_version, fragments)]


def round_shapes(
    shapes: Mapping[str, tuple[int, ...]], fragments: int, base_version: int
) -> dict[str, tuple[int, ...]]:
    """``shapes`` restricted to the tensors the round on ``base_version`` syncs."""
    return {n: tuple(shapes[n]) for n in round_names(shapes, fragments, base_version)}
