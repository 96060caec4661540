"""A member's relays share its uplink as a queue (``sync.relay.Relayer``, ADR 0034): in order,
``SLOTS`` at a time; a copy not begun when its round has an input set is dropped; BUSY while
the queued copies would outlast the round's collecting time. Over a fake link of fixed rate."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from p2pdiloco.net.sync_rpc import RpcError, RpcRefused
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.sync import relay
from p2pdiloco.sync.relay import SLOTS, Relayer

PAYLOAD = b"x" * 10_000


class Link:
    """Answers each submit after len(frames) / rate seconds (copies at once do not share the
    rate); ``later`` peers say "later" once (or ``times`` times)."""

    def __init__(self, rate: float, later: Sequence[str] = (), times: int = 1) -> None:
        self.rate = rate
        self.later = {p: times for p in later}
        self.started: list[str] = []
        self.done: list[str] = []
        self.at_once = 0
        self.most_at_once = 0

    async def call(
        self, peer: str, op: str, *, frames: Sequence[bytes] = (), **_: Any
    ) -> tuple[dict[str, Any], list[bytes]]:
        assert op == "submit"
        tag = f"{peer}/{frames[0].decode()}"
        self.started.append(tag)
        self.at_once += 1
        self.most_at_once = max(self.most_at_once, self.at_once)
        try:
            await asyncio.sleep(sum(len(f) for f in frames) / self.rate)
        finally:
            self.at_once -= 1
        if self.later.get(peer):
            self.later[peer] -= 1
            return {"status": "rejected", "code": Reason.NO_OPEN_ROUND.value}, []
        self.done.append(tag)
        return {"status": "accepted"}, []


def test_copies_leave_in_order_a_few_at_a_time_and_the_uplink_is_measured() -> None:
    async def go() -> None:
        link = Link(rate=1e6)  # 10 ms a copy
        relayer = Relayer(link)  # type: ignore[arg-type]
        assert relayer.rate() is None and relayer.backlog_s() == 0.0
        tasks = [
            asyncio.create_task(relayer.relay(["B", "C"], f"d{i}".encode(), PAYLOAD, lambda: True))
            for i in range(4)
        ]
        while not link.started:  # the first copies are under way
            await asyncio.sleep(0)
        assert relayer.queued_bytes > 0
        assert await asyncio.gather(*tasks) == [2, 2, 2, 2]
        assert link.most_at_once == SLOTS
        assert link.started == [f"{p}/d{i}" for i in range(4) for p in ("B", "C")]
        assert relayer.queued_bytes == 0
        rate = relayer.rate()
        assert rate is not None and 1.0e6 < rate < 2.2e6  # SLOTS copies at 1 MB/s each

    asyncio.run(go())


def test_copies_not_begun_when_the_round_closes_are_dropped() -> None:
    async def go() -> None:
        link = Link(rate=1e6)
        relayer = Relayer(link)  # type: ignore[arg-type]
        open_ = [True]
        tasks = [
            asyncio.create_task(
                relayer.relay(["B", "C", "D"], f"d{i}".encode(), PAYLOAD, lambda: open_[0])
            )
            for i in range(5)
        ]
        while len(link.started) < SLOTS:  # the first copies are under way
            await asyncio.sleep(0)
        open_[0] = False  # the round agreed: those finish, the 13 others are dropped
        held = sum(await asyncio.gather(*tasks))
        assert held == SLOTS and len(link.started) == len(link.done) == held
        assert relayer.queued_bytes == 0

    asyncio.run(go())


def test_an_unreachable_fellow_does_not_make_the_uplink_look_slow() -> None:
    """The copy to B (10 ms) and the dials to a dead fellow, the first begun beside it (each
    failing after 50 ms, no byte sent), share the uplink's busy time: only the copy's 10 ms
    may count. Time is the relayer's clock, which the fake link moves, not the machine's: a
    loaded machine that runs the event loop late measures the same."""
    now = [0.0]
    copied = asyncio.Event()

    class Dead(Link):
        dial = 0.05  # seconds a dial to a dead peer takes to fail

        async def call(
            self, peer: str, op: str, *, frames: Sequence[bytes] = (), **kw: Any
        ) -> tuple[dict[str, Any], list[bytes]]:
            start = now[0]
            if peer == "dead":
                await copied.wait()  # the dial outlasts the copy begun beside it
                now[0] = start + self.dial  # a dial that times out: no byte leaves
                raise RpcError("cannot open a stream to dead: unreachable")
            await asyncio.sleep(0)  # both are under way before either ends
            now[0] = start + sum(len(f) for f in frames) / self.rate
            copied.set()
            self.done.append(f"{peer}/{frames[0].decode()}")
            return {"status": "accepted"}, []

    async def go() -> None:
        link = Dead(rate=1e6)
        relayer = Relayer(link, clock=lambda: now[0])  # type: ignore[arg-type]
        assert await relayer.relay(["B", "dead"], b"d0", PAYLOAD, lambda: True) == 1
        # the dead fellow was dialled ATTEMPTS times: 0.2 s of dials, none of it counted
        assert link.done == ["B/d0"] and now[0] == pytest.approx(relay.ATTEMPTS * Dead.dial)
        rate = relayer.rate()
        assert rate is not None and rate > 0.5e6  # the 10 ms copy to B, not the 50 ms dial
        assert rate == pytest.approx(link.rate)  # exactly: B's bytes over B's copy time

    asyncio.run(go())


def test_a_later_answer_is_retried_while_the_round_collects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fellow not in the round yet (loading the view's state, restarted) answers "later" for
    as long as that takes: more than ``ATTEMPTS`` times here, and it still gets the copy (ADR
    0037). Once the round stops collecting, the relayer gives up."""
    monkeypatch.setattr(relay, "LATER_EVERY", 0.001)

    async def go() -> None:
        link = Link(rate=1e7, later=["C"], times=3 * relay.ATTEMPTS)
        relayer = Relayer(link)  # type: ignore[arg-type]
        assert await relayer.relay(["B", "C"], b"d0", PAYLOAD, lambda: True) == 2
        assert link.started.count("C/d0") == 3 * relay.ATTEMPTS + 1
        link = Link(rate=1e7, later=["C"], times=100)
        asks = iter(range(100))
        collecting = lambda: next(asks) < 10  # noqa: E731
        assert await Relayer(link).relay(["C"], b"d1", PAYLOAD, collecting) == 0  # type: ignore[arg-type]
        assert 2 <= link.started.count("C/d1") <= 10

    asyncio.run(go())


class Round:
    """What the relayer asks of a round: has it an input set, and how long it may collect."""

    def __init__(self, left: float, undecided: bool = True) -> None:
        self.left, self.undecided = left, undecided

    def collecting_left(self, now: float) -> float:
        return self.left


def measured(queued_s: float) -> Relayer:
    relayer = Relayer(Link(rate=1e6))  # type: ignore[arg-type]
    relayer._sent, relayer._busy_s = 1e6, 1.0  # measured: 1 MB/s
    relayer.queued_bytes = int(queued_s * 1e6)
    return relayer


@pytest.mark.parametrize(
    ("queued_s", "left_s", "busy"),
    [(0.0, 0.0, False), (0.5, 2.0, False), (3.0, 2.0, True), (0.5, 0.0, True)],
)
def test_busy_while_the_queued_copies_would_outlast_the_collecting_time(
    queued_s: float, left_s: float, busy: bool
) -> None:
    why = measured(queued_s).busy(Round(left_s), 0.0)  # type: ignore[arg-type]
    assert (why is not None) is busy
    assert why is None or "send later" in why


def test_nothing_is_refused_before_the_uplink_was_measured_or_once_the_set_is_agreed() -> None:
    relayer = Relayer(Link(rate=1e6))  # type: ignore[arg-type]
    relayer.queued_bytes = 10**9
    assert relayer.busy(Round(0.0), 0.0) is None  # type: ignore[arg-type]
    assert measured(3.0).busy(Round(0.0, undecided=False), 0.0) is None  # type: ignore[arg-type]
    assert measured(3.0).busy(None, 0.0) is None


class Intake:
    def screen_header(self, op: str, peer: str, first: bytes) -> tuple[int, str] | None:
        return (1234, first.decode()) if op == "submit" else None


def test_a_learners_own_upload_is_refused_busy_from_its_header() -> None:
    """The screen runs before the payload is read: a learner told BUSY there uploads nothing
    more; a fellow member's relayed copy (its stream peer is not the signer) is never BUSY."""
    screen = measured(3.0).screening(Intake(), lambda: Round(1.0))  # type: ignore[arg-type,return-value]
    with pytest.raises(RpcRefused) as e:
        screen("submit", "learner", b"learner")
    assert e.value.code is Reason.BUSY
    assert screen("submit", "member", b"learner") == 1234  # a relayed copy
    assert screen("fetch", "learner", b"x") is None
    idle = measured(0.0).screening(Intake(), lambda: Round(1.0))  # type: ignore[arg-type,return-value]
    assert idle("submit", "learner", b"learner") == 1234


class HeaderLater(Link):
    """Refuses ``times`` copies from the header with NO_OPEN_ROUND at once (no payload)."""

    def __init__(self, rate: float, times: int) -> None:
        super().__init__(rate)
        self.refusals = times

    async def call(
        self, peer: str, op: str, *, frames: Sequence[bytes] = (), **kw: Any
    ) -> tuple[dict[str, Any], list[bytes]]:
        if self.refusals:
            self.refusals -= 1
            await asyncio.sleep(0)
            raise RpcError("not in the round yet", refused=True, code=Reason.NO_OPEN_ROUND)
        return await super().call(peer, op, frames=frames, **kw)


def test_later_from_the_header_is_no_sample_of_the_uplink(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dozens of "later" answers from the header, each an instant with no payload, leave the
    uplink estimate to the copies that moved (ADR 0037)."""
    monkeypatch.setattr(relay, "LATER_EVERY", 0.0)

    async def go() -> None:
        link = HeaderLater(rate=1e6, times=40)  # then 10 ms a copy
        relayer = Relayer(link)  # type: ignore[arg-type]
        assert await relayer.relay(["C"], b"d0", PAYLOAD, lambda: True) == 1
        rate = relayer.rate()
        assert rate is not None and 0.3e6 < rate < 1.5e6, rate

    asyncio.run(go())


class Down(Link):
    """``C`` cannot be reached: every dial fails."""

    async def call(
        self, peer: str, op: str, *, frames: Sequence[bytes] = (), **kw: Any
    ) -> tuple[dict[str, Any], list[bytes]]:
        if peer == "C":
            raise RpcError("connect failed")
        return await super().call(peer, op, frames=frames, **kw)


def test_a_fellow_that_cannot_be_reached_is_reported_to_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The round hears which fellows' dials failed (``SyncerRound.on_unreachable``, ADR 0038)
    and which answered (``on_reached``): an unreachable leader need not be waited for until its
    grace deadline, nor a quorum out of reach until the view's timeout (ADR 0041)."""
    monkeypatch.setattr(relay, "ATTEMPTS", 2)
    heard: list[str] = []
    reached: list[str] = []

    class Heard:
        def on_unreachable(self, peer: str, now: float) -> None:
            heard.append(peer)

        def on_reached(self, peer: str) -> None:
            reached.append(peer)

    async def go() -> None:
        relayer = Relayer(Down(rate=1e7), current=lambda: Heard())  # type: ignore[arg-type, return-value]
        assert await relayer.relay(["B", "C"], b"d0", PAYLOAD, lambda: True) == 1

    asyncio.run(go())
    assert heard == ["C", "C"]
    assert reached == ["B"]  # a fellow that answered clears what an earlier failure said
