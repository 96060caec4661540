"""How a member sends its fellows a message (``sync.sending``, ADR 0037): a fellow that is not
in the round yet ("later") is asked again for as long as the sender still wants it taken; other
retryable failures get a few tries; a refusal for good ends it at once."""

from __future__ import annotations

import asyncio

from p2pdiloco.core.delivery import fetch_order, intake_order
from p2pdiloco.net.sync_rpc import RpcError
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.sync.sending import LATER_EVERY, LATER_TRIES, send_to


class Fellow:
    """Answers with the codes in ``answers`` in turn (None: unreachable), then takes it."""

    def __init__(self, *answers: Reason | None) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def call(self, peer: str, op: str, frames: list[bytes]) -> object:
        self.calls += 1
        if self.answers:
            code = self.answers.pop(0)
            if code is None:
                raise RpcError("connection refused")
            raise RpcError(f"refused: {code.value}", refused=True, code=code)
        return {}


def _send(fellow: Fellow, **how: object) -> tuple[bool, list[float]]:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    ok = asyncio.run(send_to(fellow.call, "peer", "propose", b"frame", sleep=sleep, **how))  # type: ignore[arg-type]
    return ok, slept


def test_a_fellow_not_in_the_round_yet_gets_it_once_it_is() -> None:
    fellow = Fellow(*[Reason.NO_OPEN_ROUND] * 20)
    ok, slept = _send(fellow, later_while=lambda: True)
    assert ok and fellow.calls == 21 and slept == [LATER_EVERY] * 20


def test_without_a_wait_condition_later_gets_the_usual_four_tries() -> None:
    fellow = Fellow(*[Reason.NO_OPEN_ROUND] * 20)
    ok, slept = _send(fellow)
    assert not ok and fellow.calls == 4 and slept == [1.0, 2.0, 3.0]


def test_the_wait_ends_when_the_sender_no_longer_wants_it_or_after_the_cap() -> None:
    wanted = iter([True, True, False])
    fellow = Fellow(*[Reason.NO_OPEN_ROUND] * 20)
    ok, _ = _send(fellow, later_while=lambda: next(wanted))
    assert not ok and fellow.calls == 2
    fellow = Fellow(*[Reason.NO_OPEN_ROUND] * (LATER_TRIES + 5))
    ok, _ = _send(fellow, later_while=lambda: True)
    assert not ok and fellow.calls == LATER_TRIES


def test_unreachable_and_refusals_are_not_waited_on() -> None:
    fellow = Fellow(None, None, None, None, None)
    ok, _ = _send(fellow, later_while=lambda: True)
    assert not ok and fellow.calls == 4  # a fellow that is down: four tries, as before
    fellow = Fellow(Reason.NOT_ON_COMMITTEE)
    ok, slept = _send(fellow, later_while=lambda: True)
    assert not ok and fellow.calls == 1 and slept == []


def test_a_fellow_without_an_open_round_is_reported_behind_once_per_send() -> None:
    """The sender then catches it up (the TC of its view, ``core.views.catch_up``); another
    refusal, or a fellow that is down, is not "behind"."""
    told: list[str] = []
    fellow = Fellow(None, *[Reason.NO_OPEN_ROUND] * 5)
    ok, _ = _send(fellow, later_while=lambda: True, behind=told.append)
    assert ok and fellow.calls == 7 and told == ["peer"]
    told.clear()
    ok, _ = _send(Fellow(None, Reason.NOT_ON_COMMITTEE), behind=told.append)
    assert not ok and told == []


def test_fetches_go_first_to_the_member_a_learner_uploaded_to_then_the_proposer() -> None:
    """``fetch_order`` (ADR 0037): a member lacking an agreed input asks the fellow its learner
    uploaded it to (the first of ``intake_order`` for a learner off the committee, but for the
    asking member itself, which lacks it), then the
    proposer, then the rest; so a round's fetches spread over every member's uplink."""
    members = [f"m{i}" for i in range(8)]
    firsts = []
    for k in range(200):
        d = f"{k:064x}"
        order = fetch_order(d, members, "m3", "m0")
        # the member the learner got to: this one lacks it, so the next in the learner's order
        intake = [m for m in intake_order(d, members, "learner") if m != "m3"][0]
        assert "m3" not in order and sorted(order) == sorted(set(members) - {"m3"})
        assert order[:2] == ([intake, "m0"] if intake != "m0" else ["m0", order[1]])
        firsts.append(order[0])
    # the first asked is spread over the members, not always the proposer
    assert max(firsts.count(m) for m in members) < 0.3 * len(firsts)


def test_the_sender_hears_who_answered_and_who_could_not_be_reached() -> None:
    """``reached(peer, ok)`` after every try: True when the fellow answered (taken, or refused:
    it is there), False when the try could not reach it; the round counts those toward a
    quorum out of reach (ADR 0041), and an answer after a failure clears it. "Later" and BUSY
    are answers, not failures."""
    for answers, ok_sent, heard in [
        ((None, Reason.BUSY), True, [False, True, True]),
        ((None, None, None, None), False, [False] * 4),
        ((Reason.BUSY,) * 4, False, [True] * 4),
        ((Reason.WRONG_RUN,), False, [True]),
    ]:
        got: list[bool] = []
        ok, _ = _send(Fellow(*answers), reached=lambda p, r, got=got: got.append(r))
        assert ok is ok_sent and got == heard, answers


def test_what_a_send_found_is_told_to_the_round_current_on_the_same_base() -> None:
    """A vote sent as view 0 ends goes to the next view's committee: a failure to reach that
    view's leader is told to the round the member opened for the next view, since it is on the
    same base version, and never to a round on another base (``heard_from``)."""
    from p2pdiloco.core.round import RoundParams, SyncerRound
    from p2pdiloco.sync.sending import heard_from

    def rnd(version: int, committee: tuple[str, ...]) -> SyncerRound:
        p = RoundParams(
            run_id="run",
            version=version,
            committee=committee,
            quorum=3,
            active_learners=4,
            opened_at=0.0,
            grace=60.0,
            staleness=0,
            max_tokens_per_step=1000,
            weight_cap=0.5,
        )
        return SyncerRound(p, "me")

    view1 = rnd(10, ("lead", "me", "b", "c"))
    current: list[SyncerRound] = [view1]
    heard_from(lambda: current[0], 10, "lead", False)
    assert "lead" in view1.reach.gone
    assert view1.reach.gone.get(view1.leader(0.0)) is not None  # what leader_silent reads
    later = rnd(11, ("lead", "me", "b", "c"))
    current[0] = later
    heard_from(lambda: current[0], 10, "b", False)  # a send from version 10's round
    assert not later.reach.gone
