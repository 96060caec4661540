"""Clone folding (sync.clones, ADR 0036): copies of one vector count as one row in the merge."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from p2pdiloco.aggregate.rows import RowSet
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.sync.aggregator import MergeInput, merge_round
from p2pdiloco.sync.clones import fold_clones
from p2pdiloco.train.outer import OuterConfig

SHAPES = {"b": (300,), "a": (40, 25)}
OUTER = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)


def _honest(m: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{n: 1e-2 * torch.randn(s, generator=gen) for n, s in SHAPES.items()} for _ in range(m)]


def _scaled(delta: dict[str, torch.Tensor], c: float) -> dict[str, torch.Tensor]:
    return {n: c * t for n, t in delta.items()}


def _inputs(deltas: list[dict[str, torch.Tensor]], trusted: int | None = None) -> list[MergeInput]:
    trusted = len(deltas) if trusted is None else trusted
    return [
        MergeInput(digest=f"d{i}", peer_id=f"p{i}", delta=d, weight=1.0, trusted=i < trusted)
        for i, d in enumerate(deltas)
    ]


def _state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(9)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}, {}


def _rows(deltas: list[dict[str, torch.Tensor]]) -> RowSet:
    return RowSet([[d[n] for n in sorted(SHAPES)] for d in deltas])


def test_honest_deltas_are_not_clones_even_with_norms_apart_4x() -> None:
    deltas = [_scaled(d, 0.5 + i / 4) for i, d in enumerate(_honest(8))]
    assert fold_clones(_rows(deltas), list(range(8)), list(range(8)), 0.25) == {}


def test_two_tiny_honest_deltas_fold_and_both_keep_their_receipts() -> None:
    """The known false positive (ADR 0036): two learners whose deltas are 1/10 of the others'
    (a tenth of the steps) are closer to each other than 0.25 × the spread. They merge as one
    row; both are still accepted."""
    deltas = [_scaled(d, 0.1 if i < 2 else 1.0) for i, d in enumerate(_honest(8))]
    assert fold_clones(_rows(deltas), list(range(8)), list(range(8)), 0.25) == {1: 0}
    rules = SyncRules(aggregation="trimmed_mean", aggregation_params={"f": 1}, clone_factor=0.25)
    result = merge_round(*_state(), _inputs(deltas), rules=rules, outer=OUTER)
    assert result.folded == {"d1": "d0"} and len(result.accepted) == 8


def test_copies_fold_into_the_first_of_their_group_transitively() -> None:
    honest = _honest(5)
    bad = _scaled(honest[0], -3.0)
    near = {n: t + 1e-6 * torch.ones_like(t) for n, t in bad.items()}  # jitter far below spread
    deltas = [honest[0], bad, honest[1], near, honest[2], bad, honest[3], honest[4]]
    folded = fold_clones(_rows(deltas), list(range(8)), list(range(8)), 0.25)
    assert folded == {3: 1, 5: 1}
    # factor 0: exact copies only
    assert fold_clones(_rows(deltas), list(range(8)), list(range(8)), 0.0) == {5: 1}


def test_a_copied_honest_delta_is_the_one_kept() -> None:
    """The mimic attack: later rows copy an honest one; the group merges as the honest row."""
    honest = _honest(5)
    deltas = [*honest, honest[2], honest[2]]
    assert fold_clones(_rows(deltas), list(range(7)), list(range(7)), 0.25) == {5: 2, 6: 2}


def test_far_copies_do_not_stretch_the_spread_onto_honest_pairs() -> None:
    """3 of 8 copies far from the honest deltas: most pairs then hold one copy, and a scale from
    all pairs would be ~5× the honest spacing and fold honest pairs; the per-row median does not."""
    honest = _honest(5)
    far = {n: 3e-1 * torch.ones_like(t) for n, t in honest[0].items()}
    deltas = [*honest, far, far, far]
    assert fold_clones(_rows(deltas), list(range(8)), list(range(8)), 0.25) == {6: 5, 7: 5}


def test_probationary_rows_do_not_set_the_spread() -> None:
    """Three trusted honest rows and five tight probationary ones: the spread is the trusted
    rows', so the tight group folds though it is most of the rows."""
    honest = _honest(3)
    base = _scaled(honest[0], -1.0)
    gen = torch.Generator().manual_seed(5)
    tight = [
        {n: t + 1e-4 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
        for _ in range(5)
    ]
    deltas = [*honest, *tight]
    rows = list(range(8))
    assert fold_clones(_rows(deltas), rows, [0, 1, 2], 0.25) == {4: 3, 5: 3, 6: 3, 7: 3}
    # with every row trusted the tight group is the majority, sets the spread, and stays
    assert fold_clones(_rows(deltas), rows, rows, 0.25) == {}


def test_merge_with_folding_is_the_merge_without_the_copies_and_receipts_every_one() -> None:
    honest = _honest(5)
    bad = _scaled(honest[0], -2.0)
    deltas = [*honest, bad, bad, bad]
    rules = SyncRules(aggregation="trimmed_mean", aggregation_params={"f": 1}, clone_factor=0.25)
    params, momentum = _state()
    folded = merge_round(params, momentum, _inputs(deltas), rules=rules, outer=OUTER)
    alone = merge_round(params, momentum, _inputs(deltas[:6]), rules=rules, outer=OUTER)
    assert folded.folded == {"d6": "d5", "d7": "d5"}
    assert folded.accepted == [f"d{i}" for i in range(8)]
    for n in SHAPES:
        assert torch.equal(folded.params[n], alone.params[n])
    # without folding the three copies pull the trimmed mean: a different state
    off = rules.model_copy(update={"clone_factor": None})
    plain = merge_round(params, momentum, _inputs(deltas), rules=off, outer=OUTER)
    assert plain.folded == {}
    assert not torch.equal(plain.params["a"], folded.params["a"])


def test_folding_below_the_rule_minimum_falls_back_to_the_median() -> None:
    honest = _honest(2)
    deltas = [honest[0], honest[1], honest[1], honest[1]]
    rules = SyncRules(aggregation="trimmed_mean", aggregation_params={"f": 1}, clone_factor=0.0)
    result = merge_round(*_state(), _inputs(deltas), rules=rules, outer=OUTER)
    assert result.folded == {"d2": "d1", "d3": "d1"}
    assert result.rule == "median (fallback from trimmed_mean)"


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_clone_factor_is_bounded(bad: float) -> None:
    with pytest.raises(ValidationError):
        SyncRules(clone_factor=bad)
