"""One merge, one attack: the simulator's outer step is the syncer's, bit for bit.

The syncer path is rebuilt here as ``sync/service.py`` drives it: decoded deltas keyed by
sorted submission ids, ``merge_weights`` over (tokens, lag), ``merge_round`` on the certified
params and momentum. The simulator path is ``harness.simulate.merge_fragment`` on a live model.
Shapes: D parameters; deltas are dicts of named tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import p2pdiloco.harness.simulate as simulate_mod
import p2pdiloco.train.learner as learner_mod
from p2pdiloco.compress import get_codec
from p2pdiloco.compress.wire import unpack_deltas
from p2pdiloco.core.weights import merge_weights
from p2pdiloco.harness.simulate import SimulateConfig, build_attackers, learner_id, merge_fragment
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.sync.aggregator import MergeInput, merge_round
from p2pdiloco.train.attacks import AttackConfig, Attacker
from p2pdiloco.train.data import build_corpus
from p2pdiloco.train.learner import Learner
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.outer import OuterConfig
from p2pdiloco.train.tokenizer import load_tokenizer

SHAPES = {"emb": (16, 8), "a.w": (8, 8), "a.b": (8,), "z": (3, 5)}
OUTER = OuterConfig(lr=0.7, momentum=0.9)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _round_deltas(seed: int, m: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {n: (0.5 + i / m) * 1e-2 * torch.randn(s, generator=gen) for n, s in SHAPES.items()}
        for i in range(m)
    ]


def _through_codec(delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a syncer decodes from a learner's int8 payload."""
    codec = get_codec("int8")
    return {n: codec.decode(codec.encode(t)) for n, t in delta.items()}


def _syncer_merge(
    params: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor],
    deltas: list[dict[str, torch.Tensor]],
    tokens: list[int],
    rules: SyncRules,
) -> tuple[list[str], dict[str, str], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The service's merge of one round: agreed ids in sorted order, capped token weights."""
    ids = sorted(learner_id(i) for i in range(len(deltas)))
    weights = merge_weights({d: (tokens[i], 0) for i, d in enumerate(ids)}, rules.weight_cap)
    inputs = [MergeInput(d, f"peer-{d}", deltas[i], weights[d]) for i, d in enumerate(ids)]
    result = merge_round(params, momentum, inputs, rules=rules, outer=OUTER)
    return result.accepted, result.rejected, result.params, result.momentum


@pytest.mark.parametrize(
    ("rules", "attack"),
    [
        (SyncRules(), None),
        (SyncRules(aggregation="trimmed_mean", aggregation_params={"f": 1}), "sign-flip"),
        (SyncRules(aggregation="median", weight_cap=0.3), "scale"),
        (SyncRules(aggregation="multi_krum", aggregation_params={"f": 1}), "alie"),
    ],
)
def test_simulate_merge_is_the_syncer_merge_bit_for_bit(
    rules: SyncRules, attack: str | None
) -> None:
    m, rounds = 6, 4
    gen = torch.Generator().manual_seed(0)
    theta = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}  # the live model
    sim_momentum: dict[str, torch.Tensor] = {}
    net_params = {n: t.clone() for n, t in theta.items()}
    net_momentum: dict[str, torch.Tensor] = {}
    attacker = Attacker(AttackConfig(attack), num_learners=m) if attack else None
    names = sorted(SHAPES)
    rejected_any = False
    for r in range(rounds):
        deltas = _round_deltas(100 + r, m)
        if attacker is not None:
            deltas[-1] = attacker.transform(deltas[-1], deltas[:-1], r)
        deltas = [_through_codec(d) for d in deltas]
        tokens = [1000 + 250 * i * (r + 1) for i in range(m)]  # unequal: weights matter

        sim = merge_fragment(theta, sim_momentum, deltas, tokens, names, rules=rules, outer=OUTER)
        accepted, rejected, net_params, net_momentum = _syncer_merge(
            net_params, net_momentum, deltas, tokens, rules
        )
        assert (sim.accepted, sim.rejected) == (accepted, rejected)
        rejected_any |= bool(rejected)
        for n in names:
            assert torch.equal(theta[n], net_params[n]), (r, n)
            assert torch.equal(sim_momentum[n], net_momentum[n]), (r, n)
    assert rejected_any == (attack in ("sign-flip", "scale"))  # 4× and 20× norms


def test_a_fragment_merge_touches_only_its_tensors() -> None:
    gen = torch.Generator().manual_seed(1)
    theta = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    before = {n: t.clone() for n, t in theta.items()}
    momentum: dict[str, torch.Tensor] = {}
    deltas, tokens, part = _round_deltas(7, 4), [10, 20, 30, 40], ["a.b", "z"]
    merge_fragment(theta, momentum, deltas, tokens, part, rules=SyncRules(), outer=OUTER)
    _, _, net_params, net_momentum = _syncer_merge(
        {n: before[n] for n in part}, {}, deltas, tokens, SyncRules()
    )
    assert sorted(momentum) == sorted(net_momentum) == part
    for n in SHAPES:
        want = net_params[n] if n in part else before[n]
        assert torch.equal(theta[n], want)


def test_learner_and_simulate_use_the_same_attack_transform() -> None:
    assert learner_mod.Attacker is simulate_mod.Attacker is Attacker
    sim_attackers = build_attackers(SimulateConfig(learners=5, adversaries=2, attack="alie"))
    assert sorted(sim_attackers) == [3, 4]
    assert all(type(a) is Attacker for a in sim_attackers.values())
    assert {(a.num_learners, a.num_attackers) for a in sim_attackers.values()} == {(5, 2)}

    # A network learner's payload is exactly Attacker.transform of its honest delta, with the
    # honest spread estimated from its own deltas (no honest deltas passed), round after round.
    _, manifest, _ = create_manifest(
        Identity.generate(),
        name="t",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=2,
        committee_size=1,
        compression="none",
        inner={"batch_size": 2, "seq_len": 32, "warmup_steps": 1, "total_steps": 20},
    )
    corpus = build_corpus(
        "embedded", load_tokenizer(get_spec("gemma-tiny").tokenizer), seq_len=32, max_bytes=2**20
    )
    base = {
        n: t.clone() for n, t in param_state(build_model("gemma-tiny", seed=0, device=CPU)).items()
    }
    cfg = AttackConfig("alie")
    node = Learner(manifest, corpus, "peer-a", base, device=CPU, attack=cfg, num_learners=7)
    assert type(node.attacker) is Attacker and node.attacker.num_learners == 7
    reference = Attacker(cfg, num_learners=7, num_attackers=1)
    shapes = {n: tuple(base[n].shape) for n in sorted(base)}
    for version in range(2):
        node.train(1)
        honest = {n: base[n].float() - p.detach().float() for n, p in node.params().items()}
        out = node.outgoing(version, base, tokens=64, loss=1.0)
        sent = unpack_deltas(out.payload, expected=shapes, codec="none", max_bytes=1 << 30)
        want = reference.transform(honest, None, version)
        for n in shapes:
            assert torch.equal(get_codec("none").decode(sent[n]), want[n]), (version, n)
