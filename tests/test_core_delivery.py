"""The delivery machine alone (``core.delivery``): events in, effects out, on a fake clock."""

from __future__ import annotations

from p2pdiloco.core.delivery import (
    MAX_PASSES,
    Answer,
    Committee,
    Delivery,
    DeliveryEffect,
    Pause,
    PollReceipt,
    Receipt,
    ReceiptDue,
    Send,
    Settled,
    Tell,
    Timer,
    Verdict,
    Wait,
    intake_order,
)
from p2pdiloco.protocol.reasons import Reason

MEMBERS = ("m0", "m1", "m2", "m3")
DIGEST = "d" * 64


def _start(members: tuple[str, ...] = MEMBERS, me: str = "me") -> tuple[Delivery, list[str]]:
    d = Delivery(DIGEST, me)
    order = intake_order(DIGEST, members, me)
    assert d.handle(Committee(members), 0.0) == [Send((order[0],))]
    return d, order


def _sends(effects: list[DeliveryEffect]) -> list[tuple[str, ...]]:
    return [e.peers for e in effects if isinstance(e, Send)]


def _waits(effects: list[DeliveryEffect]) -> list[float]:
    return [e.until for e in effects if isinstance(e, Wait)]


def _tells(effects: list[DeliveryEffect]) -> list[Tell]:
    return [e for e in effects if isinstance(e, Tell)]


def test_the_first_member_of_the_delta_order_first_and_the_learner_itself_when_a_member() -> None:
    d, order = _start()
    assert d.order == order and sorted(order) == sorted(MEMBERS)
    own = Delivery(DIGEST, "m2")
    assert own.handle(Committee(MEMBERS), 0.0) == [Send(("m2",))]  # its own syncer, no upload


def test_accepted_is_told_at_once_and_ends_the_delivery() -> None:
    d, order = _start()
    out = d.handle(Answer(order[0], "accepted"), 0.3)
    assert out == [Tell(Verdict.ACCEPTED)]
    assert not d.running and d.holders == (order[0],)
    assert d.handle(Committee(MEMBERS), 2.0) == []  # a member of this view holds it


def test_later_asks_the_same_member_again_a_second_after_its_answer() -> None:
    d, order = _start()
    out = d.handle(Answer(order[0], "rejected", Reason.NO_OPEN_ROUND), 0.4)
    assert out == [Wait(1.4)] and _tells(out) == []
    assert d.handle(Timer(), 1.0) == []  # not yet
    assert d.handle(Timer(), 1.4) == [Send((order[0],))]


def test_a_refusal_ends_the_delivery_with_the_first_code_and_the_highest_hint() -> None:
    d, order = _start()
    out = d.handle(Answer(order[0], "rejected", Reason.STALE, 7), 0.2)
    assert out == [Tell(Verdict.REFUSED, Reason.STALE, 7)]
    assert not d.running and d.handle(Timer(), 5.0) == []
    # the others of this view would say the same: none of them is asked
    assert d.handle(Committee(MEMBERS), 2.0) == []


def test_an_unreachable_member_is_passed_over_at_once() -> None:
    d, order = _start()
    out = d.handle(Answer(order[0], "error"), 1.0)
    assert out == [Send((order[1],))]
    out = d.handle(Answer(order[1], "rejected", Reason.ROUND_CLOSED), 1.2)
    assert _tells(out) == [Tell(Verdict.REFUSED, Reason.ROUND_CLOSED, None)]
    assert _sends(out) == []


def test_busy_moves_on_then_every_busy_member_is_asked_again_one_at_a_time() -> None:
    d, order = _start()
    now = 0.0
    for i in range(len(order)):  # each busy: the next member at once (ADR 0046)
        now += 0.1
        out = d.handle(Answer(order[i], "rejected", Reason.BUSY), now)
        if i + 1 < len(order):
            assert out == [Send((order[i + 1],))]
    asked = []
    for _ in range(2 * len(order)):  # every one busy: the one asked longest ago, a second apart
        assert out == [Wait(now + 1.0)]
        now += 1.0
        (send,) = d.handle(Timer(), now)
        assert isinstance(send, Send) and len(send.peers) == 1  # never two uploads at once
        asked.append(send.peers[0])
        now += 0.1
        out = d.handle(Answer(send.peers[0], "rejected", Reason.BUSY), now)
    assert asked == 2 * order
    assert d.passes == 3 * len(order)


def test_when_no_member_can_be_reached_the_back_off_doubles_to_thirty_seconds() -> None:
    d, order = _start()
    now, out = 0.0, []
    for m in order:  # each unreachable: the next at once, the back-off doubling (2, 4, 8, 16)
        now += 1.0
        out = d.handle(Answer(m, "error"), now)
    # none of the four can be reached: all asked again together after 16 s, then every 30 s
    waits, pauses = [], []
    while d.running:
        pauses += [e.retry_in for e in out if isinstance(e, Pause)]
        (wait,) = _waits(out)
        waits.append(round(wait - now, 6))
        now = wait
        (send,) = d.handle(Timer(), now)
        assert isinstance(send, Send) and send.peers == tuple(order)  # asked longest ago first
        out = []
        for m in send.peers:
            now += 0.5
            out += d.handle(Answer(m, "error"), now)
    assert waits == [16.0] + [30.0] * (MAX_PASSES - len(order) - 1)
    assert pauses == [16.0, 30.0]  # said when it changes
    assert out[-1] == Pause(None) and Pause(30.0).reason == "no syncer reachable, retrying in 30 s"
    assert d.passes == MAX_PASSES and _tells(out) == []  # nobody refused: nothing to tell


def test_unreachable_ones_alone_left_back_off_up_to_eight_seconds() -> None:
    d, order = _start()
    d.handle(Answer(order[0], "rejected", Reason.ROUND_CLOSED), 0.1)  # late for view 0
    view1 = ("n1", "n2", "n3")
    out, now = d.handle(Committee(view1), 2.0), 2.0
    for _ in view1:
        (send,) = _sends(out)
        now += 1.0
        out = d.handle(Answer(send[0], "error"), now)
    waits = []
    for _ in range(4):  # a member answered (in view 0): no pause, the back-off stops at 8 s
        assert not any(isinstance(e, Pause) for e in out)
        (wait,) = _waits(out)
        waits.append(round(wait - now, 6))
        now = wait
        (send,) = _sends(d.handle(Timer(), now))
        assert send == tuple(d.order)
        for m in send:
            out = d.handle(Answer(m, "error"), now)
    assert waits == [8.0, 8.0, 8.0, 8.0]


def test_a_delivery_makes_at_most_max_passes() -> None:
    d, order = _start()
    now, sends = 0.0, 1
    out = d.handle(Answer(order[0], "rejected", Reason.NO_OPEN_ROUND), now)
    while _waits(out):
        now = _waits(out)[0]
        sends += len(_sends(d.handle(Timer(), now)))
        out = d.handle(Answer(order[0], "rejected", Reason.NO_OPEN_ROUND), now)
    assert sends == MAX_PASSES and not d.running


def test_the_trainer_is_told_once() -> None:
    d, order = _start()
    d.handle(Answer(order[0], "accepted"), 0.1)
    later = ("n0", "n1")  # a view change: none of its members holds it
    assert _sends(d.handle(Committee(later), 5.0)) == [(intake_order(DIGEST, later, "me")[0],)]
    first = d.order[0]
    assert _tells(d.handle(Answer(first, "rejected", Reason.ROUND_CLOSED), 5.3)) == []
    d2, order2 = _start()
    d2.handle(Answer(order2[0], "rejected", Reason.ROUND_CLOSED), 0.1)  # told: refused
    d2.handle(Committee(later), 5.0)
    assert _tells(d2.handle(Answer(d2.order[0], "accepted"), 5.2)) == []


def test_a_later_view_is_offered_the_delta_unless_one_of_it_holds_or_refused_it() -> None:
    d, order = _start()
    d.handle(Answer(order[0], "rejected", Reason.ROUND_CLOSED), 0.1)  # came late for view 0
    assert d.handle(Committee(MEMBERS), 2.0) == []  # same view: refused there
    view1 = (order[0], "n1", "n2")
    assert d.handle(Committee(view1), 4.0) == []  # the member that refused is in it
    view2 = ("n1", "n2", "n3")
    (send,) = d.handle(Committee(view2), 6.0)
    assert send == Send((intake_order(DIGEST, view2, "me")[0],)) and d.running and d.passes == 0


def test_a_view_change_during_a_delivery_is_taken_by_its_next_pass() -> None:
    d, order = _start()
    out = d.handle(Answer(order[0], "rejected", Reason.NO_OPEN_ROUND), 0.1)
    assert out == [Wait(1.1)]
    view1 = ("n1", "n2")
    assert d.handle(Committee(view1), 0.5) == []  # under way: no second delivery beside it
    assert d.handle(Timer(), 1.1) == [Send((order[0],))]  # the pass decided before the change
    out = d.handle(Answer(order[0], "rejected", Reason.NO_OPEN_ROUND), 1.2)
    assert out == [Send((intake_order(DIGEST, view1, "me")[0],))]  # the new view, at once


def test_dropped_is_told_once_every_holder_says_so_with_the_first_holder_code() -> None:
    d, order = _start()
    assert d.handle(ReceiptDue(), 0.0) == []  # no holder yet: nothing to ask
    d.handle(Answer(order[0], "accepted"), 0.1)
    d.handle(Committee(("n1",)), 3.0)  # a later view: a second holder
    d.handle(Answer("n1", "accepted"), 3.1)
    assert d.handle(ReceiptDue(), 4.0) == [PollReceipt((order[0], "n1"))]
    assert d.handle(Receipt("n1", True, Reason.MERGE_FAILED), 4.1) == []
    assert d.handle(Receipt("outsider", True, Reason.BUSY), 4.1) == []  # not a holder
    assert d.handle(Receipt(order[0], False), 4.2) == []  # still holds it
    out = d.handle(Receipt(order[0], True, Reason.SCREENED_OUT), 6.2)
    assert out == [Tell(Verdict.DROPPED, Reason.SCREENED_OUT)]
    assert d.done and d.handle(ReceiptDue(), 8.0) == [] and d.handle(Committee(("x",)), 9) == []


def test_a_settled_delta_is_neither_sent_nor_told() -> None:
    d, order = _start()
    out = d.handle(Answer(order[0], "error"), 1.0)
    for m in order[1:]:
        out = d.handle(Answer(m, "error"), 2.0)
    assert Pause(16.0) in out  # none reachable
    assert d.handle(Settled(), 3.0) == [Pause(None)]  # a certificate above its base
    assert d.handle(Timer(), 9.0) == [] and d.handle(Answer(order[0], "accepted"), 9.0) == []
    assert d.handle(Committee(("n1",)), 9.0) == []
