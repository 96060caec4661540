"""With work scoring, the training thread reads the rows of the version its next delta goes out
on (ADR 0062): with a delta in flight on v, the steps it trains through the round go out on
v + 1 once v + 1 is certified, so they are v + 1's rows. On v's rows every such delta showed no
advantage on its own data and real networks refused about half the honest deltas (issue 44)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from p2pdiloco.core.learner import LearnerMachine
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import WorkScoring
from p2pdiloco.runtime.trainer import Submission, Trainer
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.train.data import build_corpus
from p2pdiloco.train.learner import Learner
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.tokenizer import load_tokenizer

H = 2


def test_steps_trained_with_a_delta_in_flight_read_the_next_versions_rows() -> None:
    me = Identity.generate()
    run_id, manifest, _ = create_manifest(
        me,
        name="t",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=H,
        committee_size=1,
        compression="int8",
        inner={"batch_size": 2, "seq_len": 32, "warmup_steps": 1, "total_steps": 100},
        rules={"work": WorkScoring().model_dump()},
    )
    corpus = build_corpus(
        "embedded", load_tokenizer(get_spec("gemma-tiny").tokenizer), seq_len=32, max_bytes=2**18
    )
    params = {n: t.clone() for n, t in param_state(build_model("gemma-tiny", seed=0)).items()}
    learner = Learner(manifest, corpus, me.peer_id, params, device=torch.device("cpu"))
    events: list[tuple[str, int | None]] = []
    enough = threading.Event()
    train = learner.train

    def recorded(steps: int, version: int | None = None) -> Any:
        events.append(("train", version))
        if sum(e == "train" for e, _ in events) >= 2 * H + 1:
            enough.set()
        return train(steps, version)

    learner.train = recorded  # type: ignore[method-assign]

    def submit(sub: Submission) -> None:
        events.append(("send", sub.base_version))

    trainer = Trainer(
        learner,
        LearnerMachine(inner_steps=H, chunk=1, version=0, give_up_after=600.0),
        CertifiedState(0, None, params, {}),
        identity=me,
        run_id=run_id,
        manifest=manifest,
        submit=submit,
        catch_up=lambda v: None,
    )
    trainer.start()
    try:
        assert enough.wait(120), events
    finally:
        trainer.stop()
    assert trainer.view.error is None
    sent = events.index(("send", 0))  # the delta on version 0, no certificate since
    assert events[:sent] == [("train", 0)] * H
    after = [v for e, v in events[sent + 1 :] if e == "train"]
    assert after and set(after) == {1}, events
