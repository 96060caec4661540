"""Outer optimizer and fragments against straightforward references."""

from __future__ import annotations

import pytest
import torch

from p2pdiloco.aggregate import get_rule
from p2pdiloco.testing.outer import OuterOptimizer
from p2pdiloco.train.outer import OuterConfig, partition_fragments, pseudo_gradient


def reference_nesterov(theta, deltas, lr, mu, nesterov=True):
    """Hand-written outer SGD: b ← μb + g; θ ← θ − lr·(g + μb) (or θ − lr·b)."""
    theta = [float(x) for x in theta]
    buf = [0.0] * len(theta)
    for g in deltas:
        for j, gj in enumerate(g):
            buf[j] = mu * buf[j] + gj
            step = gj + mu * buf[j] if nesterov else buf[j]
            theta[j] -= lr * step
    return theta


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_hand_written_reference(nesterov: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(64, generator=gen, dtype=torch.float64)
    deltas = [torch.randn(64, generator=gen, dtype=torch.float64) for _ in range(5)]
    opt = OuterOptimizer(OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov))
    params = {"w": theta0.float().clone()}
    for d in deltas:
        opt.step(params, {"w": d.float()})
    expected = reference_nesterov(theta0.tolist(), [d.tolist() for d in deltas], 0.7, 0.9, nesterov)
    torch.testing.assert_close(params["w"], torch.tensor(expected, dtype=torch.float32))


def test_outer_step_matches_torch_sgd_nesterov() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(10, 7, generator=gen)
    ref = torch.nn.Parameter(w.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    ours = {"w": w.clone()}
    opt = OuterOptimizer(OuterConfig())
    for _ in range(4):
        g = torch.randn(10, 7, generator=gen)
        ref.grad = g.clone()
        sgd.step()
        opt.step(ours, {"w": g})
    torch.testing.assert_close(ours["w"], ref.detach(), rtol=1e-6, atol=1e-6)


def test_outer_state_roundtrip_continues_identically() -> None:
    gen = torch.Generator().manual_seed(2)
    gs = [torch.randn(5, generator=gen) for _ in range(4)]
    a, pa = OuterOptimizer(OuterConfig()), {"w": torch.zeros(5)}
    for g in gs:
        a.step(pa, {"w": g})
    b, pb = OuterOptimizer(OuterConfig()), {"w": torch.zeros(5)}
    for g in gs[:2]:
        b.step(pb, {"w": g})
    c = OuterOptimizer(OuterConfig())
    c.load_state_tensors(b.state_tensors())
    pc = {"w": pb["w"].clone()}
    for g in gs[2:]:
        c.step(pc, {"w": g})
    assert torch.equal(pa["w"], pc["w"])


def test_outer_step_rejects_shape_mismatch_before_touching_state() -> None:
    opt = OuterOptimizer(OuterConfig())
    params = {"a": torch.zeros(3), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match="shape"):
        opt.step(params, {"a": torch.ones(3), "b": torch.ones(4)})
    assert torch.equal(params["a"], torch.zeros(3)) and not opt.momentum


def test_pseudo_gradient_and_mean() -> None:
    base = {"w": torch.tensor([1.0, 2.0])}
    locals_ = [{"w": torch.tensor([0.0, 2.0])}, {"w": torch.tensor([1.0, 0.0])}]
    deltas = [pseudo_gradient(base, loc, ["w"]) for loc in locals_]
    assert torch.equal(deltas[0]["w"], torch.tensor([1.0, 0.0]))
    merged = get_rule("mean")(torch.stack([d["w"] for d in deltas]))
    assert torch.equal(merged, torch.tensor([0.5, 1.0]))


def test_one_outer_step_with_lr1_no_momentum_is_model_averaging() -> None:
    base = {"w": torch.tensor([1.0, 2.0, 3.0])}
    locals_ = [{"w": torch.tensor([0.0, 4.0, 3.0])}, {"w": torch.tensor([2.0, 0.0, 5.0])}]
    deltas = [pseudo_gradient(base, loc, ["w"])["w"] for loc in locals_]
    merged = {"w": get_rule("mean")(torch.stack(deltas))}
    OuterOptimizer(OuterConfig(lr=1.0, momentum=0.0)).step(base, merged)
    assert torch.equal(base["w"], torch.tensor([1.0, 2.0, 4.0]))


def test_partition_is_balanced_complete_and_deterministic() -> None:
    gen = torch.Generator().manual_seed(3)
    sizes = {f"t{i}": int(s) for i, s in enumerate(torch.randint(1, 1000, (40,), generator=gen))}
    for k in (1, 2, 3, 4, 8):
        frags = partition_fragments(sizes, k)
        assert len(frags) == k and all(frags)
        flat = [n for f in frags for n in f]
        assert sorted(flat) == sorted(sizes) and len(flat) == len(set(flat))
        loads = [sum(sizes[n] for n in f) for f in frags]
        # LPT guarantee: the heaviest fragment is within one largest item of the lightest.
        assert max(loads) - min(loads) <= max(sizes.values())
        assert frags == partition_fragments(sizes, k)
    with pytest.raises(ValueError):
        partition_fragments(sizes, 0)
    with pytest.raises(ValueError):
        partition_fragments(sizes, 41)
