"""The work scorer on a real model (sync.scoring, ADR 0062): a delta's drop on its own rows is
measured against the last certified update on the same rows, so a copy of public history shows
exactly no advantage and honest work on the learner's rows shows one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from p2pdiloco.protocol.records import RunManifest, WorkScoring, run_id_of
from p2pdiloco.protocol.signing import open_envelope
from p2pdiloco.sync.scoring import WorkScorer, paired_advantage, scaled_like
from p2pdiloco.train.data import build_corpus
from p2pdiloco.train.inner import evaluate, lm_loss
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.tokenizer import load_tokenizer

OLD_MANIFEST = Path(__file__).parent / "data" / "manifest-protocol10.json"
PEER = "learner"


@pytest.fixture(scope="module")
def setting() -> tuple[torch.nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    corpus = build_corpus(
        "embedded", load_tokenizer(get_spec("gemma-tiny").tokenizer), seq_len=32, max_bytes=2**17
    )
    model = build_model("gemma-tiny", seed=0)
    return model, corpus.train_NS, {n: t.clone() for n, t in param_state(model).items()}


def trained_delta(
    model: torch.nn.Module, base: dict[str, torch.Tensor], rows_NS: torch.Tensor, steps: int
) -> dict[str, torch.Tensor]:
    """θ − θ' after ``steps`` AdamW steps on ``rows_NS`` (8 rows a step), from ``base``."""
    with torch.no_grad():
        for n, p in param_state(model).items():
            p.copy_(base[n])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for s in range(steps):
        opt.zero_grad()
        lm_loss(model, rows_NS[8 * s : 8 * s + 8]).backward()
        opt.step()
    after = param_state(model)
    return {n: (base[n] - after[n]).detach().clone() for n in base}


def scorer_for(
    model: torch.nn.Module, train_NS: torch.Tensor, reference: str
) -> tuple[WorkScorer, torch.Tensor, torch.Tensor]:
    own, other = torch.arange(0, 32), torch.arange(32, int(train_NS.shape[0]))
    rules = WorkScoring(batches=4, rows=8, reference=reference)  # type: ignore[arg-type]
    scorer = WorkScorer(model, train_NS, rules, run_seed=0, rows_of=lambda p, v: (own, other))
    return scorer, own, other


def test_a_copy_of_the_last_update_shows_no_advantage_and_honest_work_does(setting) -> None:
    model, train_NS, base = setting
    scorer, own, other = scorer_for(model, train_NS, "last_update")
    public = trained_delta(model, base, train_NS[other[:64]], steps=8)  # the last update
    honest = trained_delta(model, base, train_NS[own], steps=4)  # every own row, once
    score = scorer.bind(base, 1, public)
    assert score(PEER, {n: 2 * t for n, t in public.items()}) == 0.0  # scaled history: exactly 0
    assert score(PEER, honest) > 0
    # Without the last update (a syncer that does not hold it) the drop is against θ.
    assert scorer.bind(base, 1, None)(PEER, honest) > 0


def test_without_a_reference_the_score_is_protocol_11s(setting) -> None:
    model, train_NS, base = setting
    scorer, _, _ = scorer_for(model, train_NS, "none")
    own_NS, other_NS = scorer.batches(PEER, 1)
    honest = trained_delta(model, base, train_NS[:32], steps=4)
    public = trained_delta(model, base, train_NS[64:128], steps=8)
    got = scorer.bind(base, 1, public)(PEER, honest)  # the reference is ignored
    scorer._load(base, None)
    before = evaluate(scorer.model, own_NS), evaluate(scorer.model, other_NS)
    scorer._load(base, honest)
    after = evaluate(scorer.model, own_NS), evaluate(scorer.model, other_NS)
    own_drop = before[0] - after[0]
    assert got == min(own_drop, own_drop - (before[1] - after[1]))


def test_paired_advantage_and_scaling() -> None:
    assert paired_advantage(2.0, 1.5, 3.0, 2.75) == 0.25  # 0.5 more on own rows, 0.25 on others
    ref = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0])}
    scaled = scaled_like(ref, {"a": torch.tensor([0.0, 10.0])})
    assert scaled is not None and torch.allclose(scaled["a"], torch.tensor([6.0, 8.0]))
    assert scaled_like(ref, {"c": torch.ones(1)}) is None  # the reference lacks a tensor
    assert scaled_like(ref, {"b": torch.ones(1)}) is None  # a zero reference
    assert scaled_like(ref, {"a": torch.zeros(2)}) is None  # a zero delta


def test_the_reference_rule_keeps_manifest_bytes_and_names_only_a_change() -> None:
    assert WorkScoring().model_dump() == json.loads(WorkScoring().model_dump_json())
    assert "reference" not in WorkScoring().model_dump()
    assert WorkScoring(reference="none").model_dump()["reference"] == "none"
    body = json.loads(OLD_MANIFEST.read_bytes())["body"]
    env = open_envelope(OLD_MANIFEST.read_bytes(), kind="manifest")
    assert RunManifest.model_validate(env.body).model_dump(mode="json") == env.body
    scored = RunManifest.model_validate({**body, "rules": {**body["rules"], "work": {}}})
    assert scored.rules.work is not None and scored.rules.work.reference == "last_update"
    assert scored.model_dump(mode="json")["rules"]["work"] == WorkScoring().model_dump()
    plain = {**body, "rules": {**body["rules"], "work": {"reference": "none"}}}
    assert run_id_of(RunManifest.model_validate(plain)) != run_id_of(scored)
