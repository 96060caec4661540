"""A member passes a learner's delta on to its fellow members: the learner uploads it once.

A learner sends each delta to one member and asks it to relay (``core.delivery``). The
member that accepts a submission straight from its signer, so asked, sends the same signed
bytes to every other member of the committee, each of which checks it like any submission:
the signature is the learner's, so a relaying member can neither alter a delta nor make one up.
A relayed copy is never relayed again (it does not come from its signer). A fellow answering
"later" because it is not in the round yet (NO_OPEN_ROUND: still loading the view's state, or
restarted) is asked again every ``sending.LATER_EVERY`` seconds while this member collects
(ADR 0037); other retryable answers get ``ATTEMPTS`` tries; a member that cannot be reached
gets the delta from a fellow's proposal instead (``fetch``), as before.

The copies share the member's uplink as a queue (ADR 0034): at most ``SLOTS`` are sent at
once, in the order they were queued, and a copy not begun by the time the member has adopted
its round's input set is dropped, since the fellows then fetch what the agreed set needs and
nothing else (a copy sent after that only delays those fetches). And a member refuses a
learner's delta with BUSY, which the learner retries, while the copies it has queued would
outlast the round's collecting time (its grace) on its uplink as measured: accepting it would
promise relays the round cannot use (the simulator's 10,000 peers certified nothing without
this rule).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from p2pdiloco.net.sync_rpc import RpcError, RpcRefused, Screen
from p2pdiloco.net.transport import Transport
from p2pdiloco.protocol.reasons import RETRYABLE, Reason
from p2pdiloco.sync.sending import LATER_EVERY, LATER_TRIES

if TYPE_CHECKING:
    from p2pdiloco.core.round import SyncerRound
    from p2pdiloco.sync.intake import Intake

log = logging.getLogger(__name__)

ATTEMPTS = 4
HEADER_REFUSALS = frozenset({Reason.NO_OPEN_ROUND, Reason.BUSY})  # answered before the payload
SLOTS = 2  # copies on the uplink at once: enough to keep it busy across a round trip
DECAY = 0.95  # weight of the past in the uplink estimate, per copy sent


class Relayer:
    """One member's relays: a FIFO of copies on its uplink, and what they still owe it."""

    def __init__(
        self,
        transport: Transport,
        slots: int = SLOTS,
        current: Callable[[], SyncerRound | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.current = current  # the member's round: told when a fellow cannot be reached
        self._clock = clock  # the uplink's busy time is measured on it: a test's link moves it
        self._slots = asyncio.Semaphore(slots)
        self.queued_bytes = 0  # copies waiting or in flight
        self._sent = 0.0  # decayed bytes delivered, and seconds the uplink was busy with them
        self._busy_s = 0.0
        self._active = 0
        self._since = 0.0

    def rate(self) -> float | None:
        """Bytes per second the uplink relayed at, measured while busy; None before any."""
        return self._sent / self._busy_s if self._busy_s > 0 and self._sent > 0 else None

    def backlog_s(self) -> float:
        """Seconds the queued copies still need at the measured rate (0 while unmeasured)."""
        rate = self.rate()
        return self.queued_bytes / rate if rate else 0.0

    def would_overrun(self, seconds_left: float) -> bool:
        """True when more copies would not leave within ``seconds_left`` of collecting."""
        return self.queued_bytes > 0 and self.backlog_s() > max(0.0, seconds_left)

    def busy(self, rnd: SyncerRound | None, now: float) -> str | None:
        """Why a learner's own delta is refused BUSY now (:meth:`would_overrun` on what is left
        of ``rnd``'s grace); None: take it."""
        if rnd is None or not rnd.undecided or not self.would_overrun(rnd.collecting_left(now)):
            return None
        return f"relays queued here need {self.backlog_s():.0f} s more of the uplink: send later"

    def screening(self, intake: Intake, current: Callable[[], SyncerRound | None]) -> Screen:
        """``intake.screen``, and BUSY from the header alone for a learner's own upload (the
        stream's peer signed it) while :meth:`busy`: its payload is then not read at all."""

        def screen(op: str, peer: str, first: bytes) -> int | None:
            got = intake.screen_header(op, peer, first)
            if got is None:
                return None
            if got[1] == peer and (why := self.busy(current(), self._clock())):
                raise RpcRefused(Reason.BUSY, why)
            return got[0]

        return screen

    async def relay(
        self, peers: Sequence[str], raw: bytes, payload: bytes, collecting: Callable[[], bool]
    ) -> int:
        """Send one accepted submission to ``peers``, queued behind earlier copies; how many
        hold it afterwards. ``collecting``: whether its round has no input set yet."""
        size = len(raw) + len(payload)
        self.queued_bytes += size * len(peers)
        try:
            got = await asyncio.gather(*(self._one(p, raw, payload, collecting) for p in peers))
        finally:
            self.queued_bytes -= size * len(peers)
        return sum(got)

    async def _one(
        self, peer: str, raw: bytes, payload: bytes, collecting: Callable[[], bool]
    ) -> bool:
        attempt = later = 0
        while attempt < ATTEMPTS and later < LATER_TRIES:
            async with self._slots:
                if not collecting():
                    return False  # agreed before this copy began: fetched if in the set
                self._begin()
                moved = len(raw) + len(payload)  # counted once the fellow answered
                try:
                    reply, _ = await self.transport.call(
                        peer, "submit", frames=[raw, payload], timeout=120
                    )
                    code = Reason.parse(reply["code"]) if "code" in reply else None
                    taken = reply.get("status") == "accepted"
                except RpcError as e:
                    code, taken = (e.code if e.refused else Reason.UNREACHABLE), False
                    # Unreachable, or "later"/BUSY from the header (the payload unread): no
                    # sample of the uplink (hundreds of "later" would skew it, ADR 0037).
                    moved = 0 if not e.refused or code in HEADER_REFUSALS else moved
                finally:
                    self._end(moved)
            self._tell(peer, code is not Reason.UNREACHABLE)
            if taken:
                return True
            if code not in RETRYABLE or not collecting():
                log.info("relay to %s: %s", peer[-8:], code)
                return False
            if code is Reason.NO_OPEN_ROUND:  # the fellow is not in the round yet
                later += 1
                await asyncio.sleep(LATER_EVERY)
            else:
                attempt += 1
                await asyncio.sleep(0.5 * attempt)
        return False

    def _tell(self, peer: str, answered: bool) -> None:
        """The member's round hears whether ``peer`` answered or could not be reached: its
        leader? its quorum? (ADRs 0038, 0041)."""
        rnd = self.current() if self.current is not None else None
        if rnd is not None:
            rnd.on_reached(peer) if answered else rnd.on_unreachable(peer, self._clock())

    def _begin(self) -> None:
        if self._active == 0:
            self._since = self._clock()
        self._active += 1

    def _end(self, nbytes: int) -> None:
        self._active -= 1
        now = self._clock()
        busy = now - self._since
        self._since = now
        if nbytes == 0:
            return  # a fellow that could not be reached: the uplink carried nothing meanwhile
        self._sent = self._sent * DECAY + nbytes
        self._busy_s = self._busy_s * DECAY + busy
