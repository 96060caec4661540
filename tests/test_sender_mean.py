"""``sender_mean`` (each coordinate over the learners that sent it, ADR 0061): against a NumPy
reference on sparse deltas, bit-for-bit ``mean`` where everyone sent, window by window inside
the merge; and a manifest that names no new rule merges exactly as before it existed."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from p2pdiloco.aggregate import get_rule
from p2pdiloco.aggregate.rows import WINDOW
from p2pdiloco.compress import get_codec
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.sync.aggregator import MergeInput, merge_round
from p2pdiloco.sync.rules import check_supported
from p2pdiloco.train.outer import OuterConfig, outer_update_
from tests.test_sync_rules import manifest

OUTER = OuterConfig(lr=0.7, momentum=0.9)
SHAPES = {"b": (5000,), "a": (300, 200)}  # 65,000 entries: three merge windows
WEIGHTS = [1.0, 3.0, 0.5, 2.0]
# merge_round's params and momentum under the default rules (mean) on _topk_round(), hashed by
# _digest, as the code before sender_mean existed computed them (commit 197f8f5).
GOLDEN_MEAN = "a59b78723fa009968c08e90b9974741cdac9988d397a3ebf931eee717bf9425b"


def ref_sender_mean(x: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    w = np.ones(len(x)) if w is None else w
    num = sum(w[i] * x[i] for i in range(len(x)))
    den = sum(w[i] * (x[i] != 0) for i in range(len(x)))
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def _sparse(seed: int, m: int, d: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen)
    x[torch.rand(m, d, generator=gen) < 0.8] = 0.0  # each learner sends ~1/5 of coordinates
    x[:, :7] = 0.0  # nobody sent these
    x[0, 7:20] = -0.0  # a signed zero is not a value sent
    return x


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("m,d", [(4, 300), (7, WINDOW + 99)])
def test_sender_mean_matches_numpy_reference(weighted: bool, m: int, d: int) -> None:
    x = _sparse(m, m, d)
    w = torch.tensor([1.0 + (i % 3) for i in range(m)]) if weighted else None
    before = x.clone()
    got = get_rule("sender_mean")(x, w)
    want = ref_sender_mean(x.double().numpy(), None if w is None else w.double().numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(x, before)
    assert not got[:7].any()  # no sender: no update
    dense = x.ne(0).all(0)
    assert torch.equal(got[dense], get_rule("mean")(x, w)[dense])


def test_where_every_learner_sent_it_is_mean_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 3000, generator=gen)
    for w in (None, torch.tensor([1.0, 2.0, 3.0, 1.0, 1.0, 2.0, 5.0, 0.5])):
        assert torch.equal(get_rule("sender_mean")(x, w), get_rule("mean")(x, w))
    zero = [0.0] * 8  # weights already checked (the merge's path): both fall back to uniform
    assert torch.equal(
        get_rule("sender_mean").aggregate(x, zero), get_rule("mean").aggregate(x, zero)
    )


def test_one_sender_of_four_is_applied_at_its_full_value() -> None:
    x = torch.zeros(4, 3)
    x[2] = torch.tensor([0.5, 0.0, -1.0])
    x[1, 2] = 1.0
    assert get_rule("mean")(x).tolist() == [0.125, 0.0, 0.0]
    assert get_rule("sender_mean")(x).tolist() == [0.5, 0.0, 0.0]


def _topk_round() -> tuple[dict, dict, list[MergeInput]]:
    gen = torch.Generator().manual_seed(40)
    params = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    momentum = {n: 0.1 * torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    codec = get_codec("topk2")
    inputs = []
    for i, weight in enumerate(WEIGHTS):
        delta = {
            n: codec.decode(codec.encode(1e-2 * torch.randn(s, generator=gen)))
            for n, s in SHAPES.items()
        }
        inputs.append(MergeInput(digest=f"d{i}", peer_id=f"p{i}", delta=delta, weight=weight))
    return params, momentum, inputs


def _digest(params: dict, momentum: dict) -> str:
    h = hashlib.sha256()
    for n in sorted(SHAPES):
        h.update(params[n].numpy().tobytes())
        h.update(momentum[n].numpy().tobytes())
    return h.hexdigest()


def test_a_manifest_without_the_new_rule_merges_the_bits_it_did() -> None:
    check_supported(manifest())  # an old-style manifest: rules default to mean
    assert manifest().rules == SyncRules()
    params, momentum, inputs = _topk_round()
    result = merge_round(params, momentum, inputs, rules=manifest().rules, outer=OUTER)
    assert result.rule == "mean"
    assert _digest(result.params, result.momentum) == GOLDEN_MEAN


def test_sender_mean_in_the_merge_is_the_rule_on_the_stacked_deltas() -> None:
    rules = SyncRules(aggregation="sender_mean", screen_norm_factor=None)
    check_supported(manifest(rules={"aggregation": "sender_mean"}))
    params, momentum, inputs = _topk_round()
    result = merge_round(params, momentum, inputs, rules=rules, outer=OUTER)
    assert result.rule == "sender_mean"
    names = sorted(SHAPES)
    delta_MD = torch.stack([torch.cat([inp.delta[n].reshape(-1) for n in names]) for inp in inputs])
    g = get_rule("sender_mean")(delta_MD, WEIGHTS)
    at = 0
    for n in names:
        p, buf = params[n].clone().view(-1), momentum[n].clone().view(-1)
        outer_update_(p, buf, g[at : at + p.numel()], OUTER)
        at += p.numel()
        assert torch.equal(result.params[n].view(-1), p), n
        assert torch.equal(result.momentum[n].view(-1), buf), n
    mean = merge_round(
        params, momentum, inputs, rules=SyncRules(screen_norm_factor=None), outer=OUTER
    )
    assert _digest(mean.params, mean.momentum) != _digest(result.params, result.momentum)
