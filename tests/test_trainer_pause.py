"""The training thread's compute-share pause never delays the learner (``Trainer._pause``): under a
time budget it ends at the budget's end, so the delta goes out on time, and it ends when the
runtime hands over a certificate to rebase onto. What is cut short is added to the next
pause. A slow learner that paused through both missed the round's close under CI load."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from p2pdiloco.core.learner import LearnerMachine
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.runtime.trainer import Certified, Reply, Submission, Trainer
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.train.data import build_corpus
from p2pdiloco.train.learner import Learner
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.tokenizer import load_tokenizer

STEP = 0.15  # each chunk of one step takes at least this long (a slow island)
SHARE = 0.25  # trains a quarter of the time: pauses 3× each chunk's time


class Events(list[tuple[str, float]]):
    """What the trainer did, in order; ``wait_until`` wakes at each new entry."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()

    def append(self, item: tuple[str, float]) -> None:
        with self.changed:
            super().append(item)
            self.changed.notify_all()

    def wait_until(self, pred: Any, what: str, timeout: float = 60.0) -> None:
        with self.changed:
            assert self.changed.wait_for(pred, timeout), what


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def start_trainer(budget: float | None, events: Events) -> Trainer:
    """A real learner on gemma-tiny whose chunks of one step take ``STEP`` s, at ``SHARE``;
    ``events`` records ("train", s), ("pause", asked s), ("paused", s) and ("send", 0)."""
    me = Identity.generate()
    run_id, manifest, _ = create_manifest(
        me,
        name="t",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=10_000,
        time_budget=budget,
        committee_size=1,
        compression="int8",
        inner={"batch_size": 2, "seq_len": 32, "warmup_steps": 2, "total_steps": 100},
    )
    corpus = build_corpus(
        "embedded", load_tokenizer(get_spec("gemma-tiny").tokenizer), seq_len=32, max_bytes=2**18
    )
    params = {n: t.clone() for n, t in param_state(build_model("gemma-tiny", seed=0)).items()}
    learner = Learner(manifest, corpus, me.peer_id, params, device=torch.device("cpu"))
    train = learner.train

    def slow_train(steps: int, version: int | None = None) -> Any:
        start = time.monotonic()
        out = train(steps, version)
        time.sleep(max(0.0, STEP * steps - (time.monotonic() - start)))
        events.append(("train", time.monotonic() - start))
        return out

    learner.train = slow_train  # type: ignore[method-assign]
    machine = LearnerMachine(
        inner_steps=10_000, chunk=1, version=0, give_up_after=60.0, time_budget=budget
    )

    def submit(sub: Submission) -> None:
        events.append(("send", 0.0))

    trainer = Trainer(
        learner,
        machine,
        CertifiedState(0, None, params, {}),
        identity=me,
        run_id=run_id,
        manifest=manifest,
        submit=submit,
        catch_up=lambda v: None,
        compute_share=SHARE,
    )
    wait = trainer._wake.wait

    def pause(seconds: float | None = None) -> bool:
        events.append(("pause", seconds or 0.0))
        begun = time.monotonic()
        try:
            return wait(seconds)
        finally:
            events.append(("paused", time.monotonic() - begun))

    trainer._wake.wait = pause  # type: ignore[method-assign]
    trainer.start()
    return trainer


def test_a_pause_ends_at_the_budget_and_what_is_cut_comes_after_the_send(
    one_thread: None,
) -> None:
    budget = 0.5  # one chunk and its pause (4 × 0.15 s at least) do not fit
    events = Events()
    trainer = start_trainer(budget, events)
    try:
        events.wait_until(lambda: sum(e == "paused" for e, _ in events) >= 3, "three pauses")
    finally:
        trainer.stop()
    assert trainer.view.error is None
    first = next(i for i, (e, _) in enumerate(events) if e == "send")
    before = events[:first]
    # Before the send, training and pauses together stay within the budget: the pause was cut
    # at the budget's end, however long the chunk took.
    trained = sum(s for e, s in before if e == "train")
    paused = sum(s for e, s in before if e == "paused")
    assert paused <= max(0.0, budget - trained) + 0.02
    # ... and the learner does not pause less in all: what was cut is added to the next pause,
    # the first one after the send.
    cut = trained * (1 / SHARE - 1) - paused
    assert cut > 0.05
    (kind, chunk), (pause, asked) = events[first + 1], events[first + 2]
    assert (kind, pause) == ("train", "pause")
    assert asked == pytest.approx(chunk * (1 / SHARE - 1) + cut, abs=0.02)


def test_a_certificate_ends_a_pause_at_once_and_a_reply_does_not(one_thread: None) -> None:
    events = Events()
    trainer = start_trainer(None, events)
    try:
        events.wait_until(lambda: any(e == "paused" for e, _ in events), "a first pause")
        n = len(events)
        events.wait_until(lambda: len(events) > n and events[-1][0] == "pause", "a pause under way")
        # Unbudgeted, the pause is 3 chunks' worth, at least 0.45 s. A reply does not end it
        # (nothing to do at once); a certificate does.
        trainer.deliver(Reply("not ours", True, None, None))
        assert not trainer._wake.is_set()
        params = trainer.state.params
        trainer.deliver(Certified(CertifiedState(1, None, params, {}), frozenset(), known=True))
        events.wait_until(lambda: events[-1][0] != "pause", "the pause ended")
        events.wait_until(lambda: trainer.state.version == 1, "rebased onto version 1")
    finally:
        trainer.stop()
    i = max(i for i, (e, _) in enumerate(events) if e == "pause" and events[i + 1][0] == "paused")
    (_, asked), (_, seconds) = events[i], events[i + 1]
    assert asked >= 3 * STEP and seconds < asked / 2
