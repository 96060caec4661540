"""A run's planned size sets its inner schedule (issue 40 item 2, ADR 0053): ``run create
--tokens`` signs a plan and the warm-up and cosine horizon derived from it, a learner's lr
follows that horizon, a learner past it says so once, and a manifest signed before plans
existed still verifies to the same run id."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

from p2pdiloco.cli.app import app
from p2pdiloco.core.learner import LearnerMachine
from p2pdiloco.core.roster import committee_for
from p2pdiloco.protocol.certificates import (
    Accepted,
    Certificate,
    CertificateBody,
    assemble,
    parse_certificate,
    roster_digest,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import (
    IncompatibleProtocol,
    RunManifest,
    parse_manifest,
    run_id_of,
    run_id_of_body,
)
from p2pdiloco.protocol.signing import open_envelope
from p2pdiloco.runtime.trainer import Certified, Trainer
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.train.data import build_corpus
from p2pdiloco.train.learner import Learner
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.schedule import plan_run, schedule_of
from p2pdiloco.train.tokenizer import load_tokenizer

OLD_MANIFEST = Path(__file__).parent / "data" / "manifest-protocol10.json"
# The run id the code before run plans gave that manifest (its sha256 as signed).
OLD_RUN_ID = "6ec0dd12f6593418f7611c063df87a0c5ef8f706b4bf1a2110f6f02355c3bad2"
KEY = Identity.from_seed(hashlib.sha256(b"run plan").digest())


def create_result(tmp_path: Path, *args: str) -> Result:
    """``run create --dry-run --json ARGS`` with a fixed key, through the CLI's own code."""
    key = tmp_path / "creator.key"
    if not key.exists():
        KEY.save(key)
    return CliRunner().invoke(
        app,
        [
            "run",
            "create",
            "--name",
            "plan",
            "--model",
            "gemma-tiny",
            "--dry-run",
            "--json",
            "--identity",
            str(key),
            *args,
        ],
    )


def create(tmp_path: Path, *args: str) -> tuple[str, RunManifest]:
    result = create_result(tmp_path, *args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    return out["run_id"], RunManifest.model_validate(out["manifest"])


def lr_at(learner: Learner, step: int) -> float:
    learner.seek(step)
    lrs = {g["lr"] for g in learner.optimizer.param_groups}
    assert len(lrs) == 1
    return lrs.pop()


def test_run_create_tokens_sets_the_schedule_the_learner_trains_at(tmp_path: Path) -> None:
    # 4 learners × H 50 × 4 rows × 32 tokens = 25,600 tokens a round: 2,000,000 → 79 rounds
    _, m = create(
        tmp_path,
        "--tokens",
        "2000000",
        "--inner-steps",
        "50",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--inner-lr",
        "1e-3",
    )
    assert m.plan is not None
    assert (m.plan.rounds, m.plan.learners, m.plan.tokens) == (79, 4, 79 * 25_600)
    total, warmup = 79 * 50, 79 * 50 // 10
    assert (m.inner.total_steps, m.inner.warmup_steps) == (total, warmup)

    corpus = build_corpus(
        "embedded", load_tokenizer(get_spec("gemma-tiny").tokenizer), seq_len=32, max_bytes=2**16
    )
    params = {n: t.clone() for n, t in param_state(build_model("gemma-tiny", seed=0)).items()}
    learner = Learner(m, corpus, KEY.peer_id, params, device=torch.device("cpu"))
    peak, floor = 1e-3, 1e-3 * m.inner.min_lr_ratio
    assert lr_at(learner, 0) == pytest.approx(peak / warmup)
    assert lr_at(learner, warmup - 1) == pytest.approx(peak)
    middle = warmup + (total - warmup) // 2
    assert lr_at(learner, middle) == pytest.approx((peak + floor) / 2, rel=1e-3)
    # the horizon is the plan's last round: one round before it the lr still decays ...
    before = total - 50
    cos = 0.5 * (1 + math.cos(math.pi * (before - warmup) / (total - warmup)))
    assert lr_at(learner, before) == pytest.approx(floor + (peak - floor) * cos)
    assert floor < lr_at(learner, before) < 1.01 * floor
    # ... and reaches its floor there, not after the default 10,000 steps
    assert lr_at(learner, total) == pytest.approx(floor)
    assert lr_at(learner, 10 * total) == pytest.approx(floor)

    # the lr an inner step uses is the schedule's at the step the learner was put at
    learner.seek(middle)
    used: list[float] = []
    hook = learner.optimizer.register_step_pre_hook(
        lambda opt, *_: used.append(opt.param_groups[0]["lr"])
    )
    learner.train(2)
    hook.remove()
    assert used == [
        pytest.approx(lr_at(learner, middle)),
        pytest.approx(lr_at(learner, middle + 1)),
    ]


def test_rounds_and_tokens_give_one_plan() -> None:
    by_rounds = plan_run(inner_steps=500, batch_size=8, seq_len=128, rounds=20)
    by_tokens = plan_run(inner_steps=500, batch_size=8, seq_len=128, tokens=by_rounds.tokens)
    assert by_rounds == by_tokens and by_rounds.tokens == 20 * 4 * 500 * 8 * 128
    assert schedule_of(by_rounds, 500) == (1000, 10_000)
    # more learners merge more tokens a round: the same tokens take fewer rounds
    assert (
        plan_run(
            inner_steps=500, batch_size=8, seq_len=128, tokens=by_rounds.tokens, learners=8
        ).rounds
        == 10
    )


def test_a_manifest_signed_before_plans_verifies_with_its_run_id() -> None:
    raw = OLD_MANIFEST.read_bytes()
    env = open_envelope(raw, kind="manifest")  # the signature over the bytes as signed
    # Signed at protocol 10: a node of protocol 11 verifies it and says which protocol it needs.
    with pytest.raises(IncompatibleProtocol, match="protocol version 10"):
        parse_manifest(env)
    manifest = RunManifest.model_validate(env.body)
    assert OLD_RUN_ID == run_id_of_body(env.body) == run_id_of(manifest)
    assert manifest.plan is None
    assert (manifest.inner.warmup_steps, manifest.inner.total_steps) == (100, 10_000)
    assert manifest.model_dump(mode="json") == env.body  # no field added to its bytes


def test_a_plan_and_a_horizon_that_disagree_are_refused() -> None:
    body = json.loads(OLD_MANIFEST.read_bytes())["body"]
    plan = {"rounds": 3, "tokens": 3 * 4 * 500 * 8 * 128, "learners": 4}
    with pytest.raises(ValueError, match="not the plan's 3 rounds"):
        RunManifest.model_validate({**body, "plan": plan})
    ok = RunManifest.model_validate(
        {**body, "plan": plan, "inner": {**body["inner"], "total_steps": 1500}}
    )
    assert ok.plan is not None and run_id_of(ok) != OLD_RUN_ID


def test_run_create_refuses_both_sizes(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "run",
            "create",
            "--name",
            "p",
            "--model",
            "gemma-tiny",
            "--dry-run",
            "--identity",
            str(tmp_path / "k"),
            "--tokens",
            "10",
            "--rounds",
            "2",
        ],
    )
    assert result.exit_code == 2 and "not both" in result.stderr


def certificate(run_id: str, manifest: RunManifest, version: int, steps: int) -> Certificate:
    """A certified ``version`` whose one merged delta claims ``steps`` (the run's pace)."""
    committee = committee_for(run_id, manifest, None)
    accepted = [Accepted(peer_id=KEY.peer_id, digest="ab" * 32, steps=steps, tokens=steps)]
    body = CertificateBody(
        run=run_id,
        version=version,
        base_version=version - 1,
        state_hash="cd" * 32,
        committee=list(committee.members),
        quorum=committee.quorum,
        accepted=accepted,
        roster_hash=roster_digest([]),
    )
    return parse_certificate(assemble(body, {KEY.peer_id: sign_body(KEY, body)}))


def test_a_learner_past_the_horizon_says_so_once(tmp_path: Path) -> None:
    run_id, m = create(
        tmp_path, "--rounds", "2", "--inner-steps", "5", "--batch-size", "2", "--seq-len", "16"
    )
    assert m.inner.total_steps == 10
    corpus = build_corpus(
        "embedded", load_tokenizer(get_spec("gemma-tiny").tokenizer), seq_len=16, max_bytes=2**16
    )
    params = {n: t.clone() for n, t in param_state(build_model("gemma-tiny", seed=0)).items()}
    learner = Learner(m, corpus, KEY.peer_id, params, device=torch.device("cpu"))
    machine = LearnerMachine(inner_steps=5, chunk=5, version=1, give_up_after=60.0)
    one = CertifiedState(1, certificate(run_id, m, 1, 5), params, {})
    trainer = Trainer(
        learner,
        machine,
        one,
        identity=KEY,
        run_id=run_id,
        manifest=m,
        submit=lambda s: None,
        catch_up=lambda v: None,
    )
    assert not any("past the run's planned" in e for e in trainer._c.events)  # step 5 of 10
    for v in (2, 3):  # at version 2 the schedule is at its horizon, at 3 past it
        state = CertifiedState(v, certificate(run_id, m, v, 5), params, {})
        trainer.deliver(Certified(state, frozenset()))
        trainer._drain()
    said = [e for e in trainer._c.events if "past the run's planned" in e]
    assert len(said) == 1 and "version 2" in said[0] and "10 inner steps" in said[0], said
