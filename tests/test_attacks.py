"""The attacks of ``sync.attacks`` against naive references: mimic and the colluding coalition."""

from __future__ import annotations

import pytest
import torch

from p2pdiloco.aggregate import screen
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.train.attacks import AttackConfig, Attacker, mimic_target

SHAPES = {"w": (3, 4), "b": (5,)}


def _delta(gen: torch.Generator, shift: float = 0.0) -> dict[str, torch.Tensor]:
    return {n: torch.randn(s, generator=gen) + shift for n, s in SHAPES.items()}


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([d[n].reshape(-1) for n in sorted(d)])


def test_mimic_copies_the_most_outlying_honest_learner_and_keeps_following_it() -> None:
    gen = torch.Generator().manual_seed(0)
    honest = [_delta(gen) for _ in range(5)]
    honest[3] = {n: t * 6 for n, t in honest[3].items()}  # far from the mean of the others
    attacker = Attacker(AttackConfig("mimic"), num_learners=8, num_attackers=3)
    own = _delta(gen)
    sent = attacker.transform(own, honest, 0)
    assert all(torch.equal(sent[n], honest[3][n]) for n in SHAPES)
    assert mimic_target(torch.stack([_flat(h) for h in honest])) == 3

    later = [_delta(gen) for _ in range(5)]
    later[1] = {n: t * 6 for n, t in later[1].items()}  # now learner 1 stands out: still 3
    sent = attacker.transform(_delta(gen), later, 1)
    assert all(torch.equal(sent[n], later[3][n]) for n in SHAPES)


def test_mimic_without_honest_deltas_sends_its_own() -> None:
    own = _delta(torch.Generator().manual_seed(1))
    sent = Attacker(AttackConfig("mimic"), num_learners=4).transform(own, None, 0)
    assert all(torch.equal(sent[n], own[n]) for n in SHAPES)


def test_colluders_send_one_vector_against_the_pools_mean_just_inside_screening() -> None:
    gen = torch.Generator().manual_seed(2)
    honest = [_delta(gen, shift=1.0) for _ in range(5)]
    coalition = [_delta(gen, shift=1.0) for _ in range(3)]
    cfg = AttackConfig("collude")
    members = [Attacker(cfg, num_learners=8, num_attackers=3) for _ in coalition]
    sent = [
        a.transform(own, honest, 0, coalition) for a, own in zip(members, coalition, strict=True)
    ]
    for other in sent[1:]:
        assert all(torch.equal(other[n], sent[0][n]) for n in SHAPES)

    # Reference, in float64: the pool is every learner's own delta.
    pool = torch.stack([_flat(d) for d in honest + coalition]).double()
    mean = pool.mean(0)
    median = pool.norm(dim=1).sort().values[(len(pool) - 1) // 2]
    want = -cfg.collude_norm * median * mean / mean.norm()
    got = _flat(sent[0]).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)

    # Screening with the default factor lets every copy through.
    rows = [_flat(h) for h in honest] + [_flat(s) for s in sent]
    verdict = screen(torch.stack(rows), norm_factor=SyncRules().screen_norm_factor)
    assert verdict.accepted == list(range(8))


def test_a_lone_colluder_without_a_pool_flips_its_own_delta() -> None:
    own = _delta(torch.Generator().manual_seed(3))
    sent = Attacker(AttackConfig("collude"), num_learners=4).transform(own, None, 0)
    for n in SHAPES:
        assert torch.allclose(sent[n], -2.9 * own[n], rtol=1e-5, atol=1e-6)


def test_a_zero_pool_sends_zeros() -> None:
    zero = {n: torch.zeros(s) for n, s in SHAPES.items()}
    sent = Attacker(AttackConfig("collude"), num_learners=4).transform(zero, [zero], 0, [zero])
    assert all(torch.count_nonzero(sent[n]) == 0 for n in SHAPES)


@pytest.mark.parametrize("kind", ["mimic", "collude"])
def test_new_attacks_keep_names_shapes_and_dtype(kind: str) -> None:
    gen = torch.Generator().manual_seed(4)
    own = {n: t.half() for n, t in _delta(gen).items()}
    sent = Attacker(AttackConfig(kind), num_learners=4).transform(own, [_delta(gen)], 0, [own])
    assert sorted(sent) == sorted(own)
    assert all(sent[n].shape == own[n].shape and sent[n].dtype == torch.float32 for n in SHAPES)


def test_jitter_gives_each_colluder_its_own_noise_at_the_honest_spread() -> None:
    """``jitter`` (ADR 0036): copies of one vector stop being copies, each by its own noise of
    jitter × the honest per-coordinate std; the same member and round draw the same noise."""
    gen = torch.Generator().manual_seed(3)
    honest = [_delta(gen, shift=1.0) for _ in range(5)]
    coalition = [_delta(gen, shift=1.0) for _ in range(3)]
    plain = Attacker(AttackConfig("collude"), num_learners=8, num_attackers=3)
    cfg = AttackConfig("collude", jitter=0.5)
    members = [Attacker(cfg, num_learners=8, num_attackers=3, member=i) for i in range(3)]
    base = _flat(plain.transform(coalition[0], honest, 0, coalition))
    sent = [
        _flat(a.transform(own, honest, 0, coalition))
        for a, own in zip(members, coalition, strict=True)
    ]
    sigma = torch.stack([_flat(h) for h in honest]).std(0, unbiased=False)
    for i, s in enumerate(sent):
        noise = (s - base) / sigma
        assert 0.25 < noise.std().item() < 1.0  # 0.5 in expectation, 17 values
        assert not torch.equal(s, sent[(i + 1) % 3])
    again = Attacker(cfg, num_learners=8, num_attackers=3, member=1)
    assert torch.equal(_flat(again.transform(coalition[1], honest, 0, coalition)), sent[1])
