"""LearnerMachine under the manifest's time budget (issue 10 item 4, ADR 0013): a stretch ends
after the budget or H steps, sized from the measured pace, restarted when a version lands."""

from __future__ import annotations

import pytest

from p2pdiloco.core.learner import LearnerMachine, LearnerPhase, Rebase, Send, Train
from tests.test_learner_machine import H, machine


def budgeted_stretch(m: LearnerMachine, pace: float) -> Send:
    """Train at ``pace`` seconds per step, as the machine asks, until it sends."""
    while True:
        [action] = m.next_action(0.0)
        if isinstance(action, Send):
            return action
        assert isinstance(action, Train)
        m.on_trained(action.steps, action.steps * pace)


def test_a_budgeted_stretch_ends_at_the_budget_with_as_many_steps_as_fit() -> None:
    m = machine(inner_steps=1000, chunk=250, time_budget=1.0)
    [first] = m.next_action(0.0)
    assert first == Train(1)  # the pace is unknown until a step is timed
    m.on_trained(1, 0.1)
    chunks = []
    while not isinstance(action := m.next_action(0.0)[0], Send):
        assert isinstance(action, Train)
        chunks.append(action.steps)
        m.on_trained(action.steps, action.steps * 0.1)
    # What still fits (0.9 s at 0.1 s per step), in chunks of at most a quarter of the budget,
    # so a certificate arriving mid-stretch is looked at within 0.25 s.
    assert chunks == [3, 3, 3]
    send = action
    assert send == Send(3, 10) and m.trained == 0 and m.trained_seconds == 0.0


def test_a_three_times_slower_learner_sends_a_third_of_the_steps_every_round() -> None:
    fast = machine(inner_steps=10_000, chunk=2_500, time_budget=2.0)
    slow = machine(inner_steps=10_000, chunk=2_500, time_budget=2.0)
    for _ in range(3):  # every round, both send: the slow one with fewer steps
        f, s = budgeted_stretch(fast, 0.01), budgeted_stretch(slow, 0.03)
        assert 199 <= f.steps <= 201 and 66 <= s.steps <= 68
        for m, d in ((fast, "f"), (slow, "s")):
            m.on_sent(d)
            m.on_certified(m.version + 1, frozenset({d}))


def test_h_still_bounds_a_budgeted_delta() -> None:
    m = machine(time_budget=1e6)
    assert budgeted_stretch(m, 0.01) == Send(3, H)


def test_a_budgeted_learner_with_a_delta_in_flight_trains_on_after_one_more_budget() -> None:
    m = machine(inner_steps=1000, chunk=250, time_budget=1.0)
    budgeted_stretch(m, 0.1)
    m.on_sent("d1")
    while m.phase is LearnerPhase.IN_FLIGHT:
        [action] = m.next_action(0.0)
        assert isinstance(action, Train)
        m.on_trained(action.steps, action.steps * 0.1)
    assert m.phase is LearnerPhase.OVERTIME and m.trained == 10
    [more] = m.next_action(1.0)  # overtime: chunks of a quarter of the budget, no waiting
    assert more == Train(3)  # 0.25 s at 0.1 s per step, rounded


def test_a_time_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="time_budget"):
        machine(time_budget=0.0)


def test_a_budget_restarts_when_a_version_lands_so_learners_meet_the_same_round() -> None:
    m = machine(inner_steps=1000, chunk=250, time_budget=1.0)
    budgeted_stretch(m, 0.1)
    m.on_sent("d1")
    m.on_trained(4, 0.4)  # training on while the delta is in flight
    [rebase] = m.on_certified(4, frozenset({"d1"}))
    assert isinstance(rebase, Rebase) and m.trained_seconds == 0.0 and m.trained == 4
    send = budgeted_stretch(m, 0.1)  # one whole budget after version 4 landed
    assert send == Send(4, 14)


def test_under_a_budget_a_delta_holding_carried_work_is_not_carried_again() -> None:
    # H (10,000) bounds nothing here: without this rule a delta screened out is carried, grows,
    # is screened out again, and so on for ever (seen on real processes: one learner out of
    # every round after the first miss).
    m = machine(inner_steps=10_000, chunk=2_500, time_budget=1.0)
    first = budgeted_stretch(m, 0.1)
    m.on_sent("d1")
    [rebase] = m.on_certified(m.version + 1, frozenset())  # not merged: carried
    assert rebase.carried == first.steps and m.carried == first.steps
    # Carried work holds a whole stretch: it goes out at once, early in the next round, not
    # after another budget in step with the others (it would miss by as much again).
    [second] = m.next_action(0.0)
    assert second == Send(m.version, first.steps, overtime=0, carried=first.steps)
    m.on_sent("d2")
    [rebase] = m.on_certified(m.version + 1, frozenset())  # not merged again: dropped
    assert rebase.carried == 0 and m.trained == 0 and m.carried == 0


def test_budget_left_counts_down_to_the_send_and_is_none_otherwise() -> None:
    assert machine().budget_left is None
    m = machine(inner_steps=1000, chunk=250, time_budget=1.0)
    assert m.budget_left == 1.0
    m.on_trained(1, 0.4)
    assert m.budget_left == pytest.approx(0.6)
    m.on_trained(1, 0.7)  # the stretch is done: the rest of any pause waits for the send
    assert m.stretch_done and m.budget_left is None
    assert isinstance(m.next_action(0.0)[0], Send)
    m.on_trained(1, 0.1)  # with a delta in flight the stretch's end sends nothing
    assert m.budget_left is None
