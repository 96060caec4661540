"""merge_round against a hand-written screen → mean → Nesterov reference.

Shapes: M inputs, D parameters (all tensors flattened in sorted-name order).
"""

from __future__ import annotations

import math

import pytest
import torch

from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.sync.aggregator import MergeError, MergeInput, merge_round
from p2pdiloco.train.outer import OuterConfig

SHAPES = {"w.b": (7,), "w.a": (4, 3), "z": (2, 3, 5)}  # unsorted on purpose
OUTER = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
NO_SCREEN = SyncRules(screen_norm_factor=None)
MEAN = SyncRules()
TRIMMED = SyncRules(aggregation="trimmed_mean")


def _state(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    momentum = {n: 0.1 * torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    return params, momentum


def _inputs(seed: int, m: int, weight: float = 1.0) -> list[MergeInput]:
    """M honest-looking deltas of similar norm (0.5 … 1.5 × a unit-scale draw)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        scale = 0.5 + i / max(1, m - 1)
        delta = {n: scale * 1e-2 * torch.randn(s, generator=gen) for n, s in SHAPES.items()}
        out.append(MergeInput(digest=f"d{i}", peer_id=f"p{i}", delta=delta, weight=weight))
    return out


def _flat(t: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([t[n].reshape(-1) for n in names])


def _reference(
    params: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor],
    inputs: list[MergeInput],
    cfg: OuterConfig,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Naive weighted mean (float64) then one Nesterov SGD step, tensor by tensor."""
    names = sorted(params)
    delta_MD = torch.stack([_flat(dict(i.delta), names) for i in inputs]).double()
    w_M = torch.tensor([i.weight for i in inputs], dtype=torch.float64)
    merged_D = ((w_M[:, None] * delta_MD).sum(0) / w_M.sum()).float()
    new_p, new_m, offset = {}, {}, 0
    for n in names:
        size = params[n].numel()
        g = merged_D[offset : offset + size].reshape(params[n].shape)
        offset += size
        buf = cfg.momentum * momentum[n] + g
        update = cfg.momentum * buf + g
        new_m[n] = buf
        new_p[n] = params[n] - cfg.lr * update
    return new_p, new_m


def test_mean_matches_reference() -> None:
    params, momentum = _state(0)
    inputs = _inputs(1, m=5)
    result = merge_round(params, momentum, inputs, rules=NO_SCREEN, outer=OUTER)
    want_p, want_m = _reference(params, momentum, inputs, OUTER)
    assert sorted(result.params) == sorted(SHAPES)
    assert sorted(result.momentum) == sorted(SHAPES)
    for n in SHAPES:
        assert result.params[n].dtype == torch.float32
        torch.testing.assert_close(result.params[n], want_p[n], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(result.momentum[n], want_m[n], rtol=1e-6, atol=1e-7)
    assert result.accepted == [i.digest for i in inputs]
    assert result.rejected == {}
    assert result.rule == "mean"


def test_unequal_weights_match_reference() -> None:
    params, momentum = _state(2)
    inputs = [
        MergeInput(i.digest, i.peer_id, i.delta, weight=w)
        for i, w in zip(_inputs(3, m=4), [1.0, 3.0, 0.5, 2.0], strict=True)
    ]
    result = merge_round(params, momentum, inputs, rules=NO_SCREEN, outer=OUTER)
    want_p, _ = _reference(params, momentum, inputs, OUTER)
    for n in SHAPES:
        torch.testing.assert_close(result.params[n], want_p[n], rtol=1e-6, atol=1e-7)


def test_first_round_starts_from_zero_momentum() -> None:
    params, _ = _state(4)
    inputs = _inputs(5, m=4)
    result = merge_round(params, {}, inputs, rules=NO_SCREEN, outer=OUTER)
    zeros = {n: torch.zeros(s) for n, s in SHAPES.items()}
    want_p, want_m = _reference(params, zeros, inputs, OUTER)
    for n in SHAPES:
        torch.testing.assert_close(result.params[n], want_p[n], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(result.momentum[n], want_m[n], rtol=1e-6, atol=1e-7)


def test_inputs_are_not_modified() -> None:
    params, momentum = _state(6)
    inputs = _inputs(7, m=4)
    params_before = {n: t.clone() for n, t in params.items()}
    momentum_before = {n: t.clone() for n, t in momentum.items()}
    deltas_before = [{n: t.clone() for n, t in i.delta.items()} for i in inputs]
    result = merge_round(params, momentum, inputs, rules=MEAN, outer=OUTER)
    for n in SHAPES:
        assert torch.equal(params[n], params_before[n])
        assert torch.equal(momentum[n], momentum_before[n])
        assert result.params[n].data_ptr() != params[n].data_ptr()
        assert result.momentum[n].data_ptr() != momentum[n].data_ptr()
    for inp, before in zip(inputs, deltas_before, strict=True):
        for n in SHAPES:
            assert torch.equal(inp.delta[n], before[n])


def test_scaled_input_is_screened_out() -> None:
    params, momentum = _state(8)
    inputs = _inputs(9, m=5)
    bad = inputs[2]
    inputs[2] = MergeInput(
        bad.digest, bad.peer_id, {n: 50 * t for n, t in bad.delta.items()}, bad.weight
    )
    result = merge_round(params, momentum, inputs, rules=MEAN, outer=OUTER)
    assert list(result.rejected) == ["d2"]
    assert "norm" in result.rejected["d2"]
    assert result.accepted == ["d0", "d1", "d3", "d4"]
    honest = [i for i in inputs if i.digest != "d2"]
    want_p, _ = _reference(params, momentum, honest, OUTER)
    for n in SHAPES:
        torch.testing.assert_close(result.params[n], want_p[n], rtol=1e-6, atol=1e-7)


def test_a_round_of_two_screens_out_a_flipped_delta_and_keeps_the_honest_one() -> None:
    """Each delta is held to the median of the *others* (ADR 0027): with two inputs the
    median of both is their mean, which a 4x sign flip lifts above its own norm / 3."""
    params, momentum = _state(12)
    honest, bad = _inputs(13, m=2)
    flipped = MergeInput(
        bad.digest, bad.peer_id, {n: -4 * t for n, t in bad.delta.items()}, bad.weight
    )
    result = merge_round(params, momentum, [honest, flipped], rules=MEAN, outer=OUTER)
    assert result.accepted == [honest.digest] and list(result.rejected) == [flipped.digest]
    assert "norm" in result.rejected[flipped.digest]
    # The smallest delta of a round always passes: screening never empties a round.
    tiny = MergeInput(
        bad.digest, bad.peer_id, {n: t / 100 for n, t in bad.delta.items()}, bad.weight
    )
    result = merge_round(params, momentum, [honest, tiny], rules=MEAN, outer=OUTER)
    assert tiny.digest in result.accepted


def test_trimmed_mean_with_two_left_falls_back_to_median() -> None:
    params, momentum = _state(10)
    inputs = _inputs(11, m=4)
    for k in (0, 3):
        inp = inputs[k]
        poisoned = {n: t.clone() for n, t in inp.delta.items()}
        poisoned["z"][0, 0, 0] = math.nan if k == 0 else math.inf
        inputs[k] = MergeInput(inp.digest, inp.peer_id, poisoned, inp.weight)
    result = merge_round(params, momentum, inputs, rules=TRIMMED, outer=OUTER)
    assert result.accepted == ["d1", "d2"]
    assert set(result.rejected) == {"d0", "d3"}
    assert all("finite" in r for r in result.rejected.values())
    assert "median" in result.rule and "trimmed_mean" in result.rule
    # The median of two equal-weight deltas is their mean.
    want_p, _ = _reference(params, momentum, inputs[1:3], OUTER)
    for n in SHAPES:
        torch.testing.assert_close(result.params[n], want_p[n], rtol=1e-6, atol=1e-7)


def test_trimmed_mean_with_enough_inputs_is_not_a_fallback() -> None:
    params, momentum = _state(12)
    result = merge_round(params, momentum, _inputs(13, m=5), rules=TRIMMED, outer=OUTER)
    assert result.rule == "trimmed_mean"


def test_all_non_finite_raises() -> None:
    params, momentum = _state(14)
    inputs = [
        MergeInput(i.digest, i.peer_id, {n: t * math.inf for n, t in i.delta.items()}, i.weight)
        for i in _inputs(15, m=4)
    ]
    with pytest.raises(MergeError, match="rejected every delta") as info:
        merge_round(params, momentum, inputs, rules=MEAN, outer=OUTER)
    assert isinstance(info.value, ValueError)
    assert sorted(info.value.rejected) == ["d0", "d1", "d2", "d3"]


@pytest.mark.parametrize("rule", ["mean", "trimmed_mean", "median"])
def test_deterministic(rule: str) -> None:
    params, momentum = _state(16)
    inputs = _inputs(17, m=5)
    a = merge_round(params, momentum, inputs, rules=SyncRules(aggregation=rule), outer=OUTER)
    b = merge_round(params, momentum, inputs, rules=SyncRules(aggregation=rule), outer=OUTER)
    for n in SHAPES:
        assert torch.equal(a.params[n], b.params[n])
        assert torch.equal(a.momentum[n], b.momentum[n])
    assert (a.accepted, a.rejected, a.rule) == (b.accepted, b.rejected, b.rule)


def test_malformed_tensor_is_rejected_not_raised() -> None:
    params, momentum = _state(18)
    inputs = _inputs(19, m=4)
    missing = {n: t for n, t in inputs[1].delta.items() if n != "z"}
    reshaped = {**inputs[2].delta, "w.a": inputs[2].delta["w.a"].reshape(3, 4)}
    inputs[1] = MergeInput("d1", "p1", missing, 1.0)
    inputs[2] = MergeInput("d2", "p2", reshaped, 1.0)
    result = merge_round(params, momentum, inputs, rules=NO_SCREEN, outer=OUTER)
    assert result.accepted == ["d0", "d3"]
    assert list(result.rejected) == ["d1", "d2"]
    assert "missing tensor 'z'" in result.rejected["d1"] and "shape" in result.rejected["d2"]
    want_p, _ = _reference(params, momentum, [inputs[0], inputs[3]], OUTER)
    for n in SHAPES:
        torch.testing.assert_close(result.params[n], want_p[n], rtol=1e-6, atol=1e-7)


def test_a_subset_of_names_merges_only_those() -> None:
    """One fragment: the names in ``params``; extra tensors in the deltas are ignored."""
    params, momentum = _state(20)
    inputs = _inputs(21, m=4)
    part = ["w.a", "z"]
    result = merge_round(
        {n: params[n] for n in part}, momentum, inputs, rules=NO_SCREEN, outer=OUTER
    )
    assert sorted(result.params) == sorted(result.momentum) == part
    want_p, want_m = _reference(params, momentum, inputs, OUTER)
    for n in part:
        torch.testing.assert_close(result.params[n], want_p[n], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(result.momentum[n], want_m[n], rtol=1e-6, atol=1e-7)


def test_rule_params_come_from_the_rules() -> None:
    params, momentum = _state(22)
    inputs = _inputs(23, m=5)
    f2 = SyncRules(aggregation="trimmed_mean", aggregation_params={"f": 2})
    result = merge_round(params, momentum, inputs, rules=f2, outer=OUTER)
    assert result.rule == "trimmed_mean"
    with pytest.raises(ValueError, match="trimmed_mean"):
        merge_round(
            params,
            momentum,
            inputs,
            rules=SyncRules(aggregation="trimmed_mean", aggregation_params={"g": 1}),
            outer=OUTER,
        )
