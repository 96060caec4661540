"""The certified eval loss (ADR 0059): the leader's value in the body, checked by every other
signer against its own within the manifest's tolerance; old manifests and bodies unchanged."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest
import torch

from p2pdiloco.core.round import (
    Aggregate,
    Done,
    Evaluated,
    Reject,
    RoundParams,
    Sign,
    Submission,
    SyncerRound,
)
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.certificates import (
    CertificateBody,
    assemble,
    body_digest,
    content_digest,
    parse_certificate,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import HeldOut, RunManifest, run_id_of
from p2pdiloco.protocol.signing import open_envelope
from p2pdiloco.sync.held_out import HeldOutEval
from p2pdiloco.sync.stopping import MergeStopped
from p2pdiloco.train.data import build_corpus, held_out_batches
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.tokenizer import load_tokenizer
from tests.mid_loop import stop_at_batch

COMMITTEE = ("s0", "s1", "s2")
DATA = Path(__file__).parent / "data"


def params(tolerance: float | None = 1e-3) -> RoundParams:
    return RoundParams(
        run_id="run",
        version=4,
        committee=COMMITTEE,
        quorum=2,
        active_learners=1,
        opened_at=0.0,
        max_tokens_per_step=1000,
        eval_tolerance=tolerance,
    )


def aggregating(me: str, tolerance: float | None = 1e-3) -> tuple[SyncerRound, Aggregate]:
    """A round of ``me`` that adopted the leader's one-input set and must now merge it."""
    rnd = SyncerRound(params(tolerance), me)
    actions = rnd.on_submission(Submission("l0", "run", 4, 10, 5000, "d0"), 0.0)
    if me != "s0":  # the leader proposed its set itself; the others adopt it
        actions = rnd.on_proposal("s0", ("d0",), 1.0)
    (agg,) = [a for a in actions if isinstance(a, Aggregate)]
    return rnd, agg


def test_a_second_signer_signs_the_leaders_body_when_its_own_loss_agrees() -> None:
    rnd, agg = aggregating("s1")
    # Its own merge: same content, a loss within 1e-3 of the leader's; it signs nothing yet.
    assert rnd.on_aggregated("own", agg.attempt, Evaluated("C", 2.5004)) == []
    actions = rnd.on_signature("s0", "lead", Evaluated("C", 2.5))
    assert Sign(5, "lead") in actions
    assert any(isinstance(a, Done) and a.state_hash == "lead" for a in actions)
    done = next(a for a in actions if isinstance(a, Done))
    assert done.signers == ("s0", "s1") and done.agreed_with_quorum  # it holds that state


def test_the_leaders_body_may_come_before_the_own_merge() -> None:
    rnd, agg = aggregating("s2")
    assert rnd.on_signature("s0", "lead", Evaluated("C", 3.0)) == []  # counted, not yet signed
    actions = rnd.on_aggregated("own", agg.attempt, Evaluated("C", 3.0))
    assert actions[0] == Sign(5, "lead") and isinstance(actions[-1], Done)


def test_a_leaders_loss_outside_the_tolerance_is_refused_and_nothing_is_signed() -> None:
    rnd, agg = aggregating("s1")
    rnd.on_aggregated("own", agg.attempt, Evaluated("C", 2.5))
    actions = rnd.on_signature("s0", "lead", Evaluated("C", 2.6))
    assert [type(a) for a in actions] == [Reject]
    assert actions[0].code is Reason.EVAL_MISMATCH and actions[0].peer_id == "s0"
    assert rnd.own_hash is None  # it signs nothing in this view: the view times out
    # Outvoted: when a quorum signs the leader's body anyway, this member learns it (and
    # fetches that state rather than count its own merge as it).
    (done,) = rnd.on_signature("s2", "lead")
    assert isinstance(done, Done) and done.signers == ("s0", "s2")
    assert not done.agreed_with_quorum


def test_another_merge_than_the_leaders_signs_its_own_body() -> None:
    rnd, agg = aggregating("s1")
    rnd.on_aggregated("own", agg.attempt, Evaluated("mine", 2.5))
    actions = rnd.on_signature("s0", "lead", Evaluated("theirs", 2.5))
    assert actions == [Sign(5, "own")]


def test_the_leader_signs_its_own_body_and_a_run_without_eval_is_unchanged() -> None:
    lead, agg = aggregating("s0")
    assert lead.on_aggregated("lead", agg.attempt, Evaluated("C", 2.5))[0] == Sign(5, "lead")
    plain, agg = aggregating("s1", tolerance=None)
    assert plain.on_aggregated("own", agg.attempt, Evaluated("C", 2.5))[0] == Sign(5, "own")


# -- the wire ------------------------------------------------------------------------------


def body(eval_loss: float | None = None, **kw: object) -> CertificateBody:
    fields: dict[str, object] = dict(
        run="a" * 64,
        version=3,
        base_version=2,
        state_hash="b" * 64,
        committee=[KEY.peer_id],
        quorum=1,
        accepted=[],
        roster_hash="c" * 64,
        eval_loss=eval_loss,
    )
    fields.update(kw)
    return CertificateBody.model_validate(fields)


KEY = Identity.from_seed(hashlib.sha256(b"eval").digest())


def test_a_body_without_eval_hashes_as_before_and_one_with_it_verifies() -> None:
    plain = body()
    assert "eval_loss" not in plain.model_dump(mode="json")  # the bytes of before the field
    dumped = dict(plain.model_dump(mode="json"))
    assert body_digest(CertificateBody.model_validate(dumped)) == body_digest(plain)
    measured = body(2.345)
    assert content_digest(measured) == content_digest(plain)  # measurement, not content
    assert body_digest(measured) != body_digest(plain)  # but signed
    raw = assemble(measured, {KEY.peer_id: sign_body(KEY, measured)})
    assert parse_certificate(raw, run_id="a" * 64).body.eval_loss == 2.345
    with pytest.raises(ValueError):
        body(float("nan"))


def test_an_old_manifest_still_verifies_and_a_held_out_split_changes_the_run_id() -> None:
    raw = (DATA / "manifest-protocol10.json").read_bytes()
    env = open_envelope(raw, kind="manifest", run_id="")
    old = RunManifest.model_validate(env.body)
    assert old.held_out is None and "held_out" not in old.model_dump(mode="json")
    assert old.model_dump(mode="json") == env.body  # same bytes, same signature, same run id
    named = old.model_copy(update={"held_out": HeldOut(batches=2, seed=7)})
    assert run_id_of(named) != run_id_of(old)
    again = RunManifest.model_validate(json.loads(json.dumps(named.model_dump(mode="json"))))
    assert again.held_out == HeldOut(batches=2, seed=7)


# -- the eval step -------------------------------------------------------------------------


def test_held_out_batches_are_seeded_fixed_and_never_trained_on() -> None:
    corpus = build_corpus(
        "embedded", load_tokenizer(get_spec("gemma-tiny").tokenizer), seq_len=32, max_bytes=2**20
    )
    a = held_out_batches(corpus, seed=1, batches=3, batch_size=4)
    assert [tuple(b.shape) for b in a] == [(4, 33)] * 3
    assert all(
        torch.equal(x, y)
        for x, y in zip(a, held_out_batches(corpus, seed=1, batches=3, batch_size=4), strict=True)
    )
    other = torch.cat(held_out_batches(corpus, seed=2, batches=3, batch_size=4))
    assert not torch.equal(torch.cat(a), other)
    rows = {tuple(r.tolist()) for r in torch.cat(a)}
    assert len(rows) == 12 and rows <= {tuple(r.tolist()) for r in corpus.eval_NS}


@pytest.mark.usefixtures("one_torch_thread")
def eval_step(batches: int) -> tuple[HeldOutEval, dict[str, torch.Tensor]]:
    """The eval step of a small run with ``batches`` held-out batches, and a state to score."""
    _, manifest, _ = create_manifest(
        KEY,
        name="eval",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=4,
        committee_size=1,
        inner={"batch_size": 4, "seq_len": 32},
        held_out={"batches": batches},
    )
    corpus = build_corpus(
        "embedded", load_tokenizer(get_spec("gemma-tiny").tokenizer), seq_len=32, max_bytes=2**20
    )
    state = {n: t.clone() for n, t in param_state(build_model("gemma-tiny", seed=0)).items()}
    return HeldOutEval(manifest, corpus), state


def test_the_eval_step_is_bit_exact_across_runs_and_thread_counts() -> None:
    """ADR 0059's measurement, kept: on one CPU the loss does not depend on the threads."""
    step, state = eval_step(2)
    losses = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        losses.append(step.loss(state))
    torch.set_num_threads(1)
    assert losses[0] == losses[1] == losses[2] and 0 < losses[0] < 20


def test_a_stopping_node_abandons_the_held_out_eval_at_its_next_batch() -> None:
    """The merge's eval step ends at its node's stop as its scores do (``sync.stopping``): a
    clean stop does not wait out the held-out batches, and the model keeps its mode."""
    step, state = eval_step(4)
    assert step.loss(state) > 0  # builds the model
    model = step._model
    assert model is not None
    mode = model.training
    # mid-eval: the node is told to stop
    with stop_at_batch(model, step.stop) as batches, pytest.raises(MergeStopped):
        step.loss(state)
    assert len(batches) == 2 and model.training == mode  # its mode restored
    with pytest.raises(MergeStopped):
        step.loss(state)


# -- two syncers over the in-memory network ------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("fragments", [1, 2])
def test_two_syncers_certify_the_leaders_eval_loss_checked_by_the_second(
    tmp_path: Path, fragments: int
) -> None:
    """With fragments each version's committee evaluates the whole assembled state."""
    from p2pdiloco.testing.memnet import MemoryNetwork

    async def main() -> None:
        async with MemoryNetwork(
            tmp_path,
            nodes=2,
            committee_size=2,
            fragments=fragments,
            held_out={"batches": 2, "seed": 3},
        ) as net:
            await net.wait_for(lambda: net.min_version() >= 2, 120, "two certified versions")
            for node in net.nodes:
                service = node.runtime.service
                assert service is not None and service.held_out is not None
                state = node.runtime.chain.current
                assert state is not None and state.cert is not None
                cert = parse_certificate(node.runtime.chain.certs[state.version], run_id=net.run_id)
                assert cert.body.quorum == 2 and len(cert.signers) == 2  # both signed it
                certified = cert.body.eval_loss
                assert certified is not None and 0 < certified < 20
                # This node's own eval of the certified state: the value it checked.
                own = service.held_out.loss(state.params)
                assert abs(own - certified) <= 1e-3 * max(1.0, own)
            for v in range(1, 3):
                losses = {
                    parse_certificate(n.runtime.chain.certs[v], run_id=net.run_id).body.eval_loss
                    for n in net.nodes
                }
                assert len(losses) == 1  # one certified value per version, on every node

    asyncio.run(main())


def test_a_member_that_hears_no_leader_body_signs_its_own_after_the_agree_timeout() -> None:
    rnd, agg = aggregating("s1")
    assert rnd.on_aggregated("own", agg.attempt, Evaluated("C", 2.5)) == []
    assert rnd.on_tick(10.0) == []  # starts waiting
    assert rnd.on_tick(10.0 + rnd.params.agree_timeout - 0.1) == []
    assert rnd.on_tick(10.0 + rnd.params.agree_timeout) == [Sign(5, "own")]
    assert rnd.own_hash == "own"
    # A fellow whose eval was bit-exact signed the same body: the two certify without s0.
    (done,) = rnd.on_signature("s2", "own")
    assert isinstance(done, Done) and done.signers == ("s1", "s2") and done.agreed_with_quorum


def test_run_create_signs_a_held_out_split_unless_told_not_to(tmp_path: Path) -> None:
    from tests.netutil import run_cli

    base = ["run", "create", "--name", "x", "--model", "gemma-tiny", "--rounds", "5"]
    key = ["--identity", str(tmp_path / "key"), "--dry-run", "--json"]
    out = run_cli(*base, *key, "--seed", "7", "--eval-batches", "3")
    assert out.returncode == 0, out.stderr
    manifest = json.loads(out.stdout)["manifest"]
    assert manifest["held_out"] == {"fraction": 0.05, "batches": 3, "seed": 7, "tolerance": 1e-3}
    # The outer step is the literature's at every planned length (ADR 0060).
    assert manifest["outer"]["lr"] == 0.7 and manifest["outer"]["momentum"] == 0.9
    out = run_cli(*base, *key, "--eval-batches", "0")
    assert out.returncode == 0, out.stderr
    assert "held_out" not in json.loads(out.stdout)["manifest"]


def test_a_refused_leader_body_that_completes_a_quorum_still_certifies_here() -> None:
    rnd, agg = aggregating("s1")
    rnd.on_aggregated("own", agg.attempt, Evaluated("C", 2.5))
    assert rnd.on_signature("s2", "lead") == []  # s2 seconded the leader first
    actions = rnd.on_signature("s0", "lead", Evaluated("C", 2.9))
    assert [type(a) for a in actions] == [Reject, Done]
    assert actions[0].code is Reason.EVAL_MISMATCH and actions[1].signers == ("s0", "s2")
