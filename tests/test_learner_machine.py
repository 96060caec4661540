"""LearnerMachine: the learner's outer loop as a pure state machine, driven event by event."""

from __future__ import annotations

from typing import Any

import pytest

from p2pdiloco.core.learner import (
    CatchUp,
    Drop,
    LearnerMachine,
    LearnerPhase,
    Rebase,
    Send,
    Train,
    Wait,
    round_pace,
)
from p2pdiloco.protocol.reasons import RETRYABLE, Reason

H = 10
CHUNK = 4
LATE = {Reason.ROUND_CLOSED, Reason.STALE}  # the certificate decides: carried (ADR 0026)
NON_RETRYABLE = sorted(set(Reason) - RETRYABLE - LATE)


def machine(**over: Any) -> LearnerMachine:
    kw: dict[str, Any] = {"inner_steps": H, "chunk": CHUNK, "version": 3}
    kw.update(over)
    return LearnerMachine(**kw)


def train_stretch(m: LearnerMachine, now: float = 0.0) -> list[int]:
    """Carry out the Train actions asked for until H steps are trained; the chunk sizes."""
    chunks = []
    while m.trained < m.inner_steps:
        [action] = m.next_action(now)
        assert isinstance(action, Train)
        chunks.append(action.steps)
        m.on_trained(action.steps)
    return chunks


def sent(m: LearnerMachine, digest: str = "d1", now: float = 0.0) -> Send:
    """Train the stretch, take the Send and report it sealed as ``digest``."""
    train_stretch(m, now)
    [action] = m.next_action(now)
    assert isinstance(action, Send)
    m.on_sent(digest)
    return action


def counters(m: LearnerMachine) -> tuple[int, int, int]:
    return m.sent, m.merged, m.lost


# -- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "over", [{"inner_steps": 0}, {"inner_steps": -1}, {"chunk": 0}, {"chunk": -5}]
)
def test_invalid_construction_raises(over: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        machine(**over)


def test_fresh_machine_is_training_with_zero_counters() -> None:
    m = machine()
    assert m.phase is LearnerPhase.TRAINING
    assert m.in_flight is None
    assert counters(m) == (0, 0, 0)


# -- the cycle ---------------------------------------------------------------------------------


def test_trains_in_chunks_capped_at_h_then_sends_with_the_steps_covered() -> None:
    m = machine()
    assert train_stretch(m) == [4, 4, 2]
    assert m.phase is LearnerPhase.TRAINING  # H trained, nothing sent yet

    actions = m.next_action(5.0)
    assert actions == [Send(base_version=3, steps=H)]
    assert m.in_flight is not None
    assert m.in_flight.base_version == 3
    assert m.in_flight.sent_at == 5.0
    assert m.in_flight.digest is None
    assert m.trained == 0
    assert counters(m) == (1, 0, 0)
    assert m.phase is LearnerPhase.IN_FLIGHT


def test_chunk_larger_than_h_trains_h_at_once() -> None:
    m = machine(chunk=100)
    assert train_stretch(m) == [H]


def test_keeps_training_past_the_stretch_while_in_flight_never_waiting_on_the_network() -> None:
    m = machine()
    sent(m)
    assert train_stretch(m, now=1.0) == [4, 4, 2]
    assert m.trained == H
    assert m.phase is LearnerPhase.OVERTIME
    for now in (1.0, 2.0, 100.0):  # overtime: whole chunks, never a Wait, never a second Send
        [action] = m.next_action(now)
        assert action == Train(4)
        m.on_trained(action.steps)
    assert m.trained == H + 12
    assert counters(m) == (1, 0, 0)  # training on neither sends again nor gives up early
    m.on_certified(4, frozenset({"d1"}))
    # every step since the last delta, the overtime ones counted for the fold (ADR 0019)
    assert m.next_action(101.0) == [Send(4, H + 12, 12)]


def test_overtime_steps_are_counted_once_and_a_folded_delta_is_not_carried() -> None:
    m = machine()
    sent(m)
    train_stretch(m)
    [more] = m.next_action(1.0)
    m.on_trained(more.steps)  # overtime
    m.on_reply("d1", accepted=False, code=Reason.DUPLICATE, fast_forward=None)  # dropped
    [nxt] = m.next_action(2.0)
    assert nxt == Send(3, H + 4, 4)  # the overtime steps stay with the work they belong to
    m.on_sent("d2")
    train_stretch(m, 3.0)
    [plain] = m.on_certified(4, frozenset())  # certified without the folded delta
    assert isinstance(plain, Rebase) and plain.carried == 0  # a folded delta is not carried
    assert m.next_action(4.0) == [Send(4, H, 0)]  # nothing trained in overtime this time


def test_on_sent_fills_the_digest_once() -> None:
    m = machine()
    sent(m, "first")
    assert m.in_flight is not None and m.in_flight.digest == "first"
    m.on_sent("second")
    assert m.in_flight.digest == "first"


def test_on_sent_with_nothing_in_flight_is_ignored() -> None:
    m = machine()
    m.on_sent("stray")
    assert m.in_flight is None
    assert counters(m) == (0, 0, 0)


# -- replies -----------------------------------------------------------------------------------


def test_accepted_reply_keeps_the_delta_in_flight() -> None:
    m = machine()
    sent(m)
    assert m.on_reply("d1", accepted=True, code=None, fast_forward=None) == []
    assert m.in_flight is not None and m.in_flight.accepted_by_some
    assert m.phase is LearnerPhase.IN_FLIGHT
    assert counters(m) == (1, 0, 0)


@pytest.mark.parametrize("code", NON_RETRYABLE)
def test_refusal_with_a_final_code_drops_the_delta(code: Reason) -> None:
    m = machine()
    sent(m)
    assert m.on_reply("d1", accepted=False, code=code, fast_forward=None) == [Drop(code)]
    assert m.in_flight is None
    assert counters(m) == (1, 0, 1)
    assert m.version == 3  # a refusal never moves the base
    assert m.phase is LearnerPhase.TRAINING


def test_a_delta_late_for_its_round_waits_for_the_certificate_and_is_carried() -> None:
    m = machine()
    sent(m)
    assert m.on_reply("d1", accepted=False, code=Reason.ROUND_CLOSED, fast_forward=None) == []
    assert m.in_flight is not None and counters(m) == (1, 0, 0)
    [rebase] = m.on_certified(4, frozenset({"x"}))
    assert rebase == Rebase(4, anchor_sent=True, merged=False, seek_step=None, carried=H)
    assert counters(m) == (1, 0, 1) and m.trained == H  # its steps go into the next delta


def test_a_delta_whose_fate_is_unknown_is_not_carried() -> None:
    m = machine()
    sent(m)
    [rebase] = m.on_certified(4, frozenset(), carry=False)  # moving on at stop: it may be merged
    assert rebase == Rebase(4, anchor_sent=True, merged=False, seek_step=None, carried=0)
    assert m.trained == 0


def test_a_delta_of_more_than_h_steps_is_not_carried_again() -> None:
    m = machine()
    sent(m)
    m.on_certified(4, frozenset())  # carried: H steps
    [send] = m.next_action(0.0)
    assert send == Send(4, H, overtime=0, carried=H)  # folded to one stretch's norm: ADR 0026
    m.on_trained(H)
    m.on_sent("d2")
    m.on_certified(5, frozenset())
    assert m.trained == 2 * H  # d2 held H steps: carried, beside H new ones
    [again] = m.next_action(0.0)
    assert again == Send(5, 2 * H, overtime=0, carried=H)
    m.on_sent("d3")
    [rebase] = m.on_certified(6, frozenset())
    assert rebase.carried == 0 and m.trained == 0  # d3 held 2H steps: dropped, never 3H


def test_refusal_without_a_code_drops_as_malformed() -> None:
    m = machine()
    sent(m)
    assert m.on_reply("d1", accepted=False, code=None, fast_forward=None) == [
        Drop(Reason.MALFORMED)
    ]
    assert counters(m) == (1, 0, 1)


def test_a_stale_refusal_with_a_newer_hint_catches_up_and_that_certificate_carries_it() -> None:
    m = machine()
    sent(m)
    actions = m.on_reply("d1", accepted=False, code=Reason.STALE, fast_forward=7)
    assert actions == [CatchUp(7)]
    assert m.version == 3 and m.in_flight is not None  # only a certificate moves the version
    assert counters(m) == (1, 0, 0)
    [rebase] = m.on_certified(7, frozenset({"x"}))
    assert rebase.carried == H and m.trained == H


def test_a_final_refusal_with_a_newer_hint_drops_and_catches_up() -> None:
    m = machine()
    sent(m)
    actions = m.on_reply("d1", accepted=False, code=Reason.DUPLICATE, fast_forward=7)
    assert actions == [Drop(Reason.DUPLICATE), CatchUp(7)]
    assert counters(m) == (1, 0, 1)


@pytest.mark.parametrize("hint", [3, 2, 0])
def test_fast_forward_hint_not_newer_than_the_version_is_ignored(hint: int) -> None:
    m = machine()
    sent(m)
    assert m.on_reply("d1", accepted=False, code=Reason.STALE, fast_forward=hint) == []
    assert m.on_reply("d1", accepted=False, code=Reason.BAD_CLAIM, fast_forward=hint) == [
        Drop(Reason.BAD_CLAIM)
    ]


def test_with_staleness_a_delta_a_later_round_may_merge_is_not_carried() -> None:
    """Staleness 2: the round after version 4 still takes base 3, and a syncer that moved on
    may hold our delta there. Carrying it too would count its work twice (ADR 0026)."""
    m = machine(staleness=2)
    sent(m)  # on base 3
    [rebase] = m.on_certified(4, frozenset({"x"}))
    assert rebase.carried == 0 and m.trained == 0
    m = machine(staleness=2)
    sent(m)
    [rebase] = m.on_certified(6, frozenset({"x"}))  # base 3 < 6 − 2: no round takes it now
    assert rebase.carried == H


@pytest.mark.parametrize("code", sorted(RETRYABLE))
def test_retryable_refusal_changes_nothing(code: Reason) -> None:
    m = machine()
    sent(m)
    assert m.on_reply("d1", accepted=False, code=code, fast_forward=9) == []
    assert m.in_flight is not None and m.in_flight.digest == "d1"
    assert counters(m) == (1, 0, 0)
    assert m.phase is LearnerPhase.IN_FLIGHT


def test_reply_or_drop_for_another_digest_is_ignored() -> None:
    m = machine()
    sent(m, "mine")
    assert m.on_reply("other", accepted=False, code=Reason.STALE, fast_forward=9) == []
    assert m.on_reply("other", accepted=True, code=None, fast_forward=None) == []
    assert m.on_dropped("other", Reason.MERGE_FAILED) == []
    assert m.in_flight is not None and not m.in_flight.accepted_by_some
    assert counters(m) == (1, 0, 0)


def test_reply_before_on_sent_is_ignored() -> None:
    m = machine()
    assert train_stretch(m)
    [send] = m.next_action(0.0)
    assert isinstance(send, Send)
    assert m.on_reply("d1", accepted=False, code=Reason.STALE, fast_forward=None) == []
    assert m.on_dropped("d1", Reason.MERGE_FAILED) == []
    assert counters(m) == (1, 0, 0)


def test_reply_and_drop_with_nothing_in_flight_are_ignored() -> None:
    m = machine()
    assert m.on_reply("d1", accepted=False, code=Reason.STALE, fast_forward=9) == []
    assert m.on_dropped("d1", Reason.SCREENED_OUT) == []
    assert counters(m) == (0, 0, 0)


def test_dropped_delta_is_lost_and_progress_since_is_kept() -> None:
    m = machine()
    sent(m)
    m.on_trained(3)
    assert m.on_dropped("d1", Reason.MERGE_FAILED) == [Drop(Reason.MERGE_FAILED)]
    assert m.in_flight is None
    assert m.trained == 3
    assert counters(m) == (1, 0, 1)
    assert m.on_dropped("d1", Reason.MERGE_FAILED) == []  # settled once only
    assert counters(m) == (1, 0, 1)


def test_drop_while_waiting_sends_the_next_stretch_at_once() -> None:
    m = machine()
    sent(m)
    train_stretch(m)
    assert m.phase is LearnerPhase.OVERTIME
    assert m.on_reply("d1", accepted=False, code=Reason.DUPLICATE, fast_forward=None) == [
        Drop(Reason.DUPLICATE)
    ]
    assert m.next_action(2.0) == [Send(3, H)]
    assert counters(m) == (2, 0, 1)


# -- certificates ------------------------------------------------------------------------------


def test_certificate_merging_our_delta_rebases_from_the_sent_parameters() -> None:
    m = machine()
    sent(m)
    m.on_trained(4)
    actions = m.on_certified(4, frozenset({"x", "d1"}))
    assert actions == [Rebase(4, anchor_sent=True, merged=True, seek_step=None)]
    assert m.version == 4
    assert m.in_flight is None
    assert m.trained == 4  # progress since the send is carried
    assert counters(m) == (1, 1, 0)
    assert m.phase is LearnerPhase.TRAINING


def test_certificate_without_our_delta_counts_it_lost_and_carries_its_steps() -> None:
    m = machine()
    sent(m)
    actions = m.on_certified(4, frozenset({"x", "y"}))
    assert actions == [Rebase(4, anchor_sent=True, merged=False, seek_step=None, carried=H)]
    assert counters(m) == (1, 0, 1) and m.trained == H


def test_certificate_before_on_sent_settles_the_delta_as_lost() -> None:
    m = machine()
    train_stretch(m)
    [send] = m.next_action(0.0)
    assert isinstance(send, Send)
    actions = m.on_certified(4, frozenset({"d1"}))
    assert actions == [Rebase(4, anchor_sent=True, merged=False, seek_step=None, carried=H)]
    assert counters(m) == (1, 0, 1)
    m.on_sent("d1")  # late: the delta is already settled
    assert m.in_flight is None


@pytest.mark.parametrize("skip_to", [5, 6, 20])
def test_certificate_skipping_versions_seeks_the_schedule(skip_to: int) -> None:
    m = machine()
    sent(m)
    [rebase] = m.on_certified(skip_to, frozenset({"d1"}))
    assert rebase == Rebase(skip_to, anchor_sent=True, merged=True, seek_step=skip_to * H)
    assert m.version == skip_to


@pytest.mark.parametrize("old", [3, 2, 0])
def test_certificate_not_newer_than_the_version_is_ignored(old: int) -> None:
    m = machine()
    sent(m)
    assert m.on_certified(old, frozenset({"d1"})) == []
    assert m.version == 3
    assert m.in_flight is not None
    assert counters(m) == (1, 0, 0)


def test_certificate_with_nothing_in_flight_rebases_the_stretch_under_way() -> None:
    m = machine()
    m.on_trained(CHUNK)
    actions = m.on_certified(4, frozenset({"someone"}))
    assert actions == [Rebase(4, anchor_sent=False, merged=False, seek_step=None)]
    assert counters(m) == (0, 0, 0)
    assert m.trained == CHUNK
    assert train_stretch(m) == [4, 2]  # training goes on from where it was
    assert m.next_action(0.0) == [Send(4, H)]


def test_certificate_with_nothing_in_flight_skipping_versions_seeks() -> None:
    m = machine()
    assert m.on_certified(9, frozenset()) == [
        Rebase(9, anchor_sent=False, merged=False, seek_step=9 * H)
    ]


def test_certificate_while_waiting_lets_the_next_delta_go_at_once() -> None:
    m = machine()
    sent(m)
    train_stretch(m)
    assert m.phase is LearnerPhase.OVERTIME
    m.on_certified(4, frozenset({"d1"}))
    assert m.next_action(1.0) == [Send(4, H)]
    assert counters(m) == (2, 1, 0)


# -- giving up ---------------------------------------------------------------------------------


def test_overtime_longer_than_give_up_after_drops_and_sends_at_once() -> None:
    m = machine(give_up_after=30.0)
    sent(m, now=100.0)
    train_stretch(m, now=101.0)
    [more] = m.next_action(129.9)
    assert more == Train(4)  # overtime: training on
    assert counters(m) == (1, 0, 0)

    actions = m.next_action(130.5)
    assert actions == [Drop(Reason.ROUND_CLOSED), Send(3, H)]
    assert m.in_flight is not None and m.in_flight.sent_at == 130.5
    assert m.in_flight.digest is None
    assert counters(m) == (2, 0, 1)
    assert m.phase is LearnerPhase.IN_FLIGHT

    m.on_sent("d2")
    assert m.on_reply("d1", accepted=True, code=None, fast_forward=None) == []  # the old one
    assert m.in_flight.digest == "d2" and not m.in_flight.accepted_by_some


def test_no_give_up_while_still_training_the_next_stretch() -> None:
    m = machine(give_up_after=1.0)
    sent(m, now=0.0)
    [action] = m.next_action(1000.0)
    assert isinstance(action, Train)
    assert counters(m) == (1, 0, 0)


# -- stopping ----------------------------------------------------------------------------------


def test_reaching_stop_at_goes_idle_and_waits() -> None:
    m = machine(stop_at=4)
    sent(m)
    m.on_trained(2)
    m.on_certified(4, frozenset({"d1"}))
    assert m.phase is LearnerPhase.IDLE
    for now in (0.0, 1e6):
        [action] = m.next_action(now)
        assert isinstance(action, Wait)
    assert counters(m) == (1, 1, 0)


def test_stop_at_beyond_the_version_keeps_training() -> None:
    m = machine(stop_at=5)
    m.on_certified(4, frozenset())
    assert m.phase is LearnerPhase.TRAINING
    [action] = m.next_action(0.0)
    assert isinstance(action, Train)


def test_machine_built_at_its_stop_version_is_idle() -> None:
    m = machine(version=5, stop_at=5)
    assert m.phase is LearnerPhase.IDLE
    [action] = m.next_action(0.0)
    assert isinstance(action, Wait)


def test_the_lr_schedule_follows_the_runs_pace_not_the_learners_own_count() -> None:
    # A slow learner (2 steps a round where the run does H) is put at version × pace plus the
    # progress it keeps, so it trains at the run's lr; with its own count it would lag behind
    # the run's schedule, at a higher lr, and its deltas would be screened out as outliers.
    m = machine()
    m.on_trained(2)
    m.next_action(0.0)  # nothing to send yet
    [rebase] = m.on_certified(4, frozenset(), pace=30)
    assert rebase.seek_step == 4 * 30 + 2
    assert round_pace([30, 7, 31, 29]) == 29  # the lower median: one integer for everyone
    assert round_pace([H]) == H and round_pace([]) is None
