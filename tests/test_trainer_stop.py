"""A stopping node's training thread ends after its current inner step, not its chunk.

A chunk is a quarter of a stretch (H/4 steps: minutes at H = 500 on a slow machine); the soak
saw a volunteer say "stopping cleanly" and go on training and submitting for over a minute.
Stopped mid-chunk, the steps done are real steps (the same weights as training just those
steps) and the counts agree: the learner's steps since the send, the machine's trained steps
and the stats, which the saved local progress and the next start rely on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from p2pdiloco.core.learner import LearnerMachine
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.runtime.trainer import Submission, Trainer
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.train.data import build_corpus, learner_batches
from p2pdiloco.train.learner import Learner
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.tokenizer import load_tokenizer
from tests.netutil import wait_for

CHUNK = 8  # steps of one Train: a quarter of the stretch


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def learner_and_manifest() -> tuple[Identity, str, Any, Learner]:
    me = Identity.generate()
    run_id, manifest, _ = create_manifest(
        me,
        name="t",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=4 * CHUNK,
        committee_size=1,
        inner={"batch_size": 2, "seq_len": 32, "warmup_steps": 2, "total_steps": 100},
    )
    return me, run_id, manifest, twin(me, manifest)


def twin(me: Identity, manifest: Any) -> Learner:
    """A learner of ``me`` on ``manifest`` from the same initial weights: the same rows."""
    corpus = build_corpus(
        "embedded", load_tokenizer(get_spec("gemma-tiny").tokenizer), seq_len=32, max_bytes=2**18
    )
    params = {n: t.clone() for n, t in param_state(build_model("gemma-tiny", seed=0)).items()}
    return Learner(manifest, corpus, me.peer_id, params, device=torch.device("cpu"))


def test_a_chunk_stopped_after_two_steps_is_those_two_steps(one_thread: None) -> None:
    me, _, manifest, stopped = learner_and_manifest()
    plain = twin(me, manifest)
    done: list[int] = []
    stopped.on_step = done.append
    stopped.should_stop = lambda: len(done) >= 2
    st = stopped.train(CHUNK)
    assert (st.steps, done, stopped.steps_since_send) == (2, [1, 2], 2)
    assert st.tokens == 2 * 2 * 32  # steps × batch × seq_len predicted tokens
    # The chunk's first two rows trained unstopped: the same loss and weights.
    rows = learner_batches(
        plain.corpus,
        seed=plain.seed,
        learner=0,
        num_learners=1,
        round=0,
        steps=CHUNK,
        batch_size=plain.cfg.batch_size,
    )
    ref = plain._train_batches(rows[:2])
    assert st.loss_last == ref.loss_last
    for n, t in stopped.params().items():
        assert torch.equal(t, plain.params()[n]), n
    # Never asked to stop, a chunk is trained whole.
    stopped.should_stop = None
    st = stopped.train(CHUNK)
    assert st.steps == CHUNK and stopped.steps_since_send == 2 + CHUNK


def test_the_training_thread_stops_after_its_current_step(one_thread: None) -> None:
    me, run_id, manifest, learner = learner_and_manifest()
    sent: list[Submission] = []
    machine = LearnerMachine.for_run(manifest, 0)
    assert machine.chunk == CHUNK
    trainer = Trainer(
        learner,
        machine,
        CertifiedState(0, None, learner.params(), {}),
        identity=me,
        run_id=run_id,
        manifest=manifest,
        submit=sent.append,
        catch_up=lambda v: None,
    )
    first_step, release = threading.Event(), threading.Event()
    shown = learner.on_step
    assert shown is not None and learner.should_stop is not None

    def on_step(done: int) -> None:
        shown(done)
        if not first_step.is_set():
            first_step.set()
            assert release.wait(60)  # held on its first step until the stop is asked

    learner.on_step = on_step
    trainer.start()
    try:
        assert first_step.wait(120)
        stopping = threading.Thread(target=trainer.stop)
        stopping.start()
        wait_for(
            "the stop asked", lambda: learner.should_stop is not None and learner.should_stop(), 30
        )
    finally:
        release.set()
    stopping.join(60)
    assert not trainer.alive
    assert trainer.view.error is None
    # One step of the chunk of eight, counted alike everywhere; nothing was sent.
    assert learner.steps_since_send == machine.trained == 1
    assert sent == []
