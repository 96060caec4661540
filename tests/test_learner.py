"""Learner: lr schedule seeking, the compressed outgoing delta, rebasing, data seeds, attacks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch

from p2pdiloco.compress import get_codec
from p2pdiloco.compress.wire import unpack_deltas
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest, WorkScoring
from p2pdiloco.protocol.submissions import DATA_LAG
from p2pdiloco.train.attacks import AttackConfig
from p2pdiloco.train.data import PackedCorpus, assigned_rows, build_corpus
from p2pdiloco.train.inner import lr_factor
from p2pdiloco.train.learner import Learner, Outgoing, data_seed, inner_config
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.tokenizer import load_tokenizer

CPU = torch.device("cpu")
Params = dict[str, torch.Tensor]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """The model is tiny: one thread is fastest, and spinning OpenMP workers on a busy
    machine made each inner step ~100× slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def manifest() -> RunManifest:
    _, m, _ = create_manifest(
        Identity.generate(),
        name="t",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=4,
        committee_size=1,
        compression="int8",
        inner={"batch_size": 2, "seq_len": 32, "warmup_steps": 2, "total_steps": 40},
    )
    return m


@pytest.fixture(scope="module")
def corpus() -> PackedCorpus:
    tokenizer = load_tokenizer(get_spec("gemma-tiny").tokenizer)
    return build_corpus("embedded", tokenizer, seq_len=32, max_bytes=2**20)


@pytest.fixture(scope="module")
def base() -> Params:
    model = build_model("gemma-tiny", seed=0, device=CPU)
    return {n: t.clone() for n, t in param_state(model).items()}


def _learner(
    manifest: RunManifest, corpus: PackedCorpus, base: Params, **kwargs: object
) -> Learner:
    return Learner(manifest, corpus, "peer-a", base, device=CPU, **kwargs)  # type: ignore[arg-type]


def _snapshot(learner: Learner) -> Params:
    return {n: p.detach().float().cpu().clone() for n, p in learner.params().items()}


def _decode(out: Outgoing, base: Mapping[str, torch.Tensor], codec: str) -> Params:
    expected = {n: tuple(base[n].shape) for n in sorted(base)}
    encoded = unpack_deltas(out.payload, expected=expected, codec=codec, max_bytes=1 << 30)
    assert list(encoded) == sorted(base)
    return {n: get_codec(codec).decode(e) for n, e in encoded.items()}


def _expected_lr(manifest: RunManifest, step: int) -> float:
    p = manifest.inner
    return p.lr * lr_factor(step, p.warmup_steps, p.total_steps, p.min_lr_ratio)


def _group_lrs(learner: Learner) -> list[float]:
    return [g["lr"] for g in learner.optimizer.param_groups]


def test_inner_config_mirrors_the_manifest(manifest: RunManifest) -> None:
    cfg = inner_config(manifest)
    for field in type(manifest.inner).model_fields:
        assert getattr(cfg, field) == getattr(manifest.inner, field), field


def test_seek_sets_every_group_lr(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    learner = _learner(manifest, corpus, base)
    assert len(learner.optimizer.param_groups) == 2
    assert _group_lrs(learner) == pytest.approx([_expected_lr(manifest, 0)] * 2, rel=1e-12)
    for step in (0, 1, 2, 3, 17, 39, 40, 1000):
        learner.seek(step)
        want = _expected_lr(manifest, step)
        assert _group_lrs(learner) == pytest.approx([want, want], rel=1e-12), step


def test_constructor_seeks_to_the_base_version(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    learner = _learner(manifest, corpus, base, base_version=3)
    start = 3 * manifest.inner_steps
    assert _group_lrs(learner) == pytest.approx([_expected_lr(manifest, start)] * 2, rel=1e-12)
    # The schedule carries on from there: after one inner step it is at start + 1.
    learner.train(1)
    assert _group_lrs(learner) == pytest.approx([_expected_lr(manifest, start + 1)] * 2, rel=1e-12)


def test_outgoing_decodes_to_the_delta(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    learner = _learner(manifest, corpus, base)
    learner.train(2)
    learner.train(1)
    local = _snapshot(learner)
    out = learner.outgoing(0, base, tokens=123, loss=4.5)
    assert (out.base_version, out.steps, out.tokens, out.loss) == (0, 3, 123, 4.5)
    for n in base:
        assert torch.equal(out.sent_params[n], local[n])
    decoded = _decode(out, base, "int8")
    num = den = 0.0
    for n in sorted(base):
        true = base[n].float() - local[n]
        assert decoded[n].shape == base[n].shape
        # int8 absmax blocks: error ≤ half a step of at most absmax/127 (plus fp16 scale slack).
        atol = true.abs().max().item() / 127 + 1e-7
        torch.testing.assert_close(decoded[n], true, rtol=0, atol=atol)
        num += (decoded[n] - true).pow(2).sum().item()
        den += true.pow(2).sum().item()
    assert den > 0, "training did not move the weights"
    assert (num / den) ** 0.5 < 0.02

    learner.train(1)
    assert learner.outgoing(0, base, tokens=1, loss=1.0).steps == 1


def _perturbed(base: Params, seed: int) -> Params:
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in base.items()}


def test_rebase_without_a_send_keeps_all_progress(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    learner = _learner(manifest, corpus, base)
    learner.train(1)
    local = _snapshot(learner)
    new = _perturbed(base, 1)
    learner.rebase(new, base, None)
    after = _snapshot(learner)
    for n in base:
        assert torch.equal(after[n], new[n] + (local[n] - base[n]))


def test_rebase_after_a_send_keeps_progress_since_sending(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    learner = _learner(manifest, corpus, base)
    learner.train(1)
    sent = learner.outgoing(0, base, tokens=1, loss=1.0)
    learner.train(1)
    local = _snapshot(learner)
    new = _perturbed(base, 2)
    learner.rebase(new, base, sent)
    after = _snapshot(learner)
    moved = False
    for n in base:
        assert torch.equal(after[n], new[n] + (local[n] - sent.sent_params[n]))
        moved |= not torch.equal(local[n], sent.sent_params[n])
    assert moved, "the second stretch did not move the weights"


def test_one_rebase_gives_what_the_learner_and_the_island_computed_before() -> None:
    """``rebased`` replaced two copies of the maths (``Learner.rebase`` and
    ``IslandLearner.rebase``): bit for bit what each wrote, for a delta in flight over one
    fragment (other tensors anchored at the old base) and for none."""
    from p2pdiloco.train.learner import rebase_anchor, rebased

    gen = torch.Generator().manual_seed(3)
    shapes = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}
    old = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    new = {n: t + 1e-2 * torch.randn(t.shape, generator=gen) for n, t in old.items()}
    local = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in old.items()}
    sent = Outgoing(0, b"", 1, 1, 1.0, sent_params={"b": local["b"] - 1e-4})
    for flight in (None, sent):
        anchor = rebase_anchor(old, flight)
        island_before = {n: new[n].float() + (t - anchor[n].float()) for n, t in local.items()}
        learner_before = {
            n: new[n].float() + (t.detach().float().cpu() - anchor[n].float())
            for n, t in local.items()
        }
        got = dict(rebased(local, new, old, flight))
        assert list(got) == list(local)
        for n in local:
            assert torch.equal(got[n], island_before[n])
            assert torch.equal(got[n], learner_before[n])
    assert not torch.equal(got["b"], new["b"] + (local["b"] - old["b"]))  # b anchored at θ_sent


def test_data_seed_is_stable_and_per_peer() -> None:
    a = data_seed(7, "peer-a")
    assert a == data_seed(7, "peer-a")
    assert a != data_seed(7, "peer-b")
    assert a != data_seed(8, "peer-a")
    assert 0 <= a < 2**48
    seeds = {data_seed(0, f"peer-{i}") for i in range(100)}
    assert len(seeds) == 100


def test_sign_flip_sends_minus_four_times_the_honest_delta(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    honest = _learner(manifest, corpus, base)
    attacker = _learner(manifest, corpus, base, attack=AttackConfig("sign-flip"))
    honest.train(2)
    attacker.train(2)
    # Same peer id, seed and data: the attacker trained exactly like the honest learner.
    for n, t in _snapshot(honest).items():
        assert torch.equal(t, _snapshot(attacker)[n])
    good = _decode(honest.outgoing(0, base, tokens=1, loss=1.0), base, "int8")
    bad = _decode(attacker.outgoing(0, base, tokens=1, loss=1.0), base, "int8")
    for n in sorted(base):
        atol = 4 * good[n].abs().max().item() / 127 + 1e-6
        torch.testing.assert_close(bad[n], -4 * good[n], rtol=0, atol=atol)
        assert torch.dot(bad[n].reshape(-1), good[n].reshape(-1)) < 0


def test_a_delta_not_merged_gives_back_its_error_feedback_residual(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    learner = _learner(manifest, corpus, base)
    learner.train(1)
    first = learner.outgoing(0, base, tokens=1, loss=1.0)  # merged: its residual stays
    kept = {n: t.clone() for n, t in learner.feedback.residual.items()}
    assert kept and first.residual_before == {}
    learner.train(1)
    second = learner.outgoing(0, base, tokens=1, loss=1.0)
    assert any(not torch.equal(learner.feedback.residual[n], kept[n]) for n in kept)
    learner.unsend(second)  # refused or dropped: nothing of it reached the global model
    for n in kept:
        assert torch.equal(learner.feedback.residual[n], kept[n])


def test_a_delta_not_merged_is_carried_into_the_next_one_at_one_stretchs_norm(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    """What the trainer does when a certificate lands without our delta (ADR 0014): error
    feedback given back, the sent steps counted again, rebase anchored at the old base. The
    next delta points along all the work since version 0, the sent part included, folded to
    the carried stretch's norm (ADR 0026): a late learner's delta never sets a round's median
    norm above one stretch's, where it would let a scaled attack through the screen."""
    learner = _learner(manifest, corpus, base)
    learner.train(2)
    sent = learner.outgoing(0, base, tokens=1, loss=1.0)
    carried = _norm({n: base[n].float() - sent.sent_params[n] for n in base})
    learner.train(1)
    local = _snapshot(learner)
    new_base = {n: t + 0.01 for n, t in base.items()}  # version 1, merged from others' deltas
    learner.unsend(sent)
    learner.carry(sent, base)
    assert learner.stretch_norm == pytest.approx(carried)
    learner.rebase(new_base, base, None)
    assert learner.steps_since_send == 3
    whole = {n: base[n].float() - local[n] for n in sorted(base)}  # = θ_1 − θ_local now
    nxt = learner.outgoing(1, new_base, tokens=1, loss=1.0, carried=2)
    assert nxt.steps == 3 and 0 < nxt.fold < 1
    assert nxt.fold == pytest.approx(carried / _norm(whole), rel=1e-5)
    got = _decode(nxt, base, "int8")
    for n in sorted(base):
        want = whole[n] * nxt.fold
        atol = 2 * want.abs().max().item() / 127 + 1e-6
        torch.testing.assert_close(got[n], want, rtol=0, atol=atol)
    assert learner.stretch_norm is None


def _norm(delta: Mapping[str, torch.Tensor]) -> float:
    return sum(float(d.double().square().sum()) for d in delta.values()) ** 0.5


def test_a_delta_folding_overtime_is_sent_at_the_norm_of_the_stretch_before_it(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    """ADR 0019: however many steps a learner trained on while its last delta was undecided,
    what it sends has the norm of the plain stretch it trained after that send, in the same
    direction."""
    learner = _learner(manifest, corpus, base)
    learner.train(4)
    plain = learner.outgoing(0, base, tokens=1, loss=1.0)
    assert plain.fold == 1.0
    learner.train(4)  # the next stretch, with `plain` still undecided: measured
    stretch = _snapshot(learner)
    ref = _norm({n: plain.sent_params[n] - stretch[n] for n in base})
    assert learner.measure_stretch(plain) == pytest.approx(ref)
    learner.train(8)  # overtime
    new_base = {n: t + 0.01 for n, t in base.items()}  # version 1 merged `plain`
    learner.rebase(new_base, base, plain)
    local = _snapshot(learner)
    true = {n: new_base[n].float() - local[n] for n in base}  # 12 steps since the send
    folded = learner.outgoing(1, new_base, tokens=1, loss=1.0, overtime=8)
    assert folded.steps == 12 and 0 < folded.fold < 1
    assert folded.fold == pytest.approx(ref / _norm(true), rel=1e-6)
    got = _decode(folded, new_base, "int8")
    assert _norm(got) == pytest.approx(ref, rel=0.02)  # int8 rounding on top of the fold
    cos = sum(float((got[n] * true[n]).sum()) for n in base) / (_norm(got) * _norm(true))
    assert cos > 0.99
    assert learner.stretch_norm is None  # one measure, one fold


def test_a_fold_before_any_measure_keeps_the_share_of_steps_that_were_not_overtime(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    learner = _learner(manifest, corpus, base)
    learner.train(4)
    learner.train(12)
    out = learner.outgoing(0, base, tokens=1, loss=1.0, overtime=12)
    assert out.fold == pytest.approx(4 / 16)


def test_with_work_scoring_a_learner_reads_the_rows_assigned_for_its_version(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    scored = manifest.model_copy(
        update={"rules": manifest.rules.model_copy(update={"work": WorkScoring()})}
    )
    learner = _learner(scored, corpus, base)
    h, b = scored.inner_steps, scored.inner.batch_size
    own, _ = assigned_rows(
        corpus.num_train_rows, seed=data_seed(0, "peer-a"), version=5, steps=h, batch_size=b
    )
    first = learner._assigned(3, 5)  # three steps from version 5, then three more (wrapping)
    again = learner._assigned(3, 5)
    rows_HB = own.reshape(h, b)
    assert torch.equal(first, corpus.train_NS[rows_HB[[0, 1, 2]]])
    assert torch.equal(again, corpus.train_NS[rows_HB[[3, 0, 1]]])
    assert torch.equal(
        learner._assigned(1, 6)[0],
        corpus.train_NS[
            assigned_rows(
                corpus.num_train_rows, seed=data_seed(0, "peer-a"), version=6, steps=h, batch_size=b
            )[0].reshape(h, b)[0]
        ],
    )  # a new version starts at its own first rows


def test_with_work_scoring_a_stretch_keeps_its_rows_through_rebases_and_names_them(
    manifest: RunManifest, corpus: PackedCorpus, base: Params
) -> None:
    """ADR 0066: rounds that close while a learner trains rebase it mid-stretch; its delta then
    goes out on a newer base, and was scored on that base's rows, which it had barely trained
    (the second volunteer of the README walk was refused every delta). A stretch now keeps the
    rows it started on, until they are DATA_LAG versions old, and its delta names them."""
    scored = manifest.model_copy(
        update={"rules": manifest.rules.model_copy(update={"work": WorkScoring()})}
    )
    learner = _learner(scored, corpus, base)
    h, b = scored.inner_steps, scored.inner.batch_size

    def rows(version: int) -> torch.Tensor:
        own, _ = assigned_rows(
            corpus.num_train_rows,
            seed=data_seed(0, "peer-a"),
            version=version,
            steps=h,
            batch_size=b,
        )
        return corpus.train_NS[own.reshape(h, b)]

    learner.train(1, 5)
    assert learner.data_at == (5, 1)
    learner.steps_since_send = 1  # (train counts it; kept explicit for the reader)
    assert torch.equal(learner._assigned(1, 6), rows(5)[[1]])  # rebased to 6: rows of 5 go on
    assert learner.outgoing(6, base, tokens=1, loss=1.0).data_version == 5
    assert torch.equal(learner._assigned(1, 6), rows(6)[[0]])  # a new stretch: rows of 6
    learner.steps_since_send = 1
    assert torch.equal(learner._assigned(1, 6 + DATA_LAG), rows(6 + DATA_LAG)[[0]])  # too old
    assert learner.outgoing(6 + DATA_LAG, base, tokens=1, loss=1.0).data_version == 6 + DATA_LAG


def test_a_header_names_rows_within_its_window_whatever_landed_after_the_stretch() -> None:
    """Two certificates after a stretch's last chunk can put its base more than DATA_LAG past
    its rows: the header names the window's oldest version instead of being refused unsent."""
    from p2pdiloco.runtime.trainer import _named_rows

    def out(base: int, data: int | None) -> Outgoing:
        return Outgoing(
            base_version=base,
            payload=b"",
            steps=1,
            tokens=1,
            loss=0.0,
            sent_params={},
            data_version=data,
        )

    assert _named_rows(out(10, 5)) == 10 - DATA_LAG
    assert _named_rows(out(10, 8)) == 8 and _named_rows(out(10, 12)) == 11
    assert _named_rows(out(10, None)) is None
