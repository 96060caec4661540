"""Delivering one sealed delta to the committee, as a sans-IO machine (docs/core/delivery.md).

A learner uploads each delta once (BRIEF §7b, ADR 0028): to the first member of the committee
in an order drawn from the delta's digest, so a round's uploads spread evenly over the members;
the member that accepts it relays the same signed bytes to its fellows (``sync.relay``). The
learner moves on to the next member in that order only when one cannot be reached or is busy
(BUSY: its uplink cannot relay more before the round's input set, ADRs 0034 and 0046); a member
that says "later" (``RETRYABLE``) is asked again, as are busy ones, one at a time, once every
member is busy. A refusal ends it: every honest member of a view judges a submission alike
(late, stale, malformed), and sending the payload on to the next one only to hear the same
cost late deltas up to k uploads.

A member that accepts a delta and then drops it, or refuses it falsely, costs the learner one
round, not its work: the certificate does not name the delta, so the learner keeps that
progress in its next delta (``core.learner``: not merged → unsent), whose digest draws another
member first.

:class:`Delivery` is fed events with the time and answers effects; the runtime
(``NodeRuntime``) carries them out on the asyncio loop and the transport, the simulator
(``sim.learner``) on its event heap. It asks in passes: a pass sends to the members
:func:`next_targets` names and waits for each one's answer; the next pass goes at once to a
member not asked yet, and after a back-off to one asked before (1 s, doubling up to 8 s while
only unreachable members are left, up to 30 s once none of the committee can be reached). A
delivery makes at most :data:`MAX_PASSES` passes; a later view's committee (a view change)
starts a new delivery to its members while none of them holds or refused the delta. The trainer
is told once: accepted as soon as one member holds the delta, or refused (the first code, the
highest fast-forward hint) once a delivery ends with a refusal and none holds it, or dropped
once every member that held it says it dropped it.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from p2pdiloco.protocol.reasons import RETRYABLE, Reason

MAX_PASSES = 20  # passes of one delivery: a delta is not offered forever to a silent view
RETRY = 1.0  # seconds before a member asked before is asked again
MAX_BACKOFF = 8.0  # while only unreachable members are left to ask
UNREACHABLE_BACKOFF = 30.0  # once no member of the committee can be reached


class Status(enum.Enum):
    """A member's latest answer to this delta."""

    ACCEPTED = "accepted"  # it holds the delta (and relays it)
    REJECTED = "rejected"  # refused, or "later" (then it is on the retry list)
    BUSY = "busy"  # BUSY: its uplink is full (ADR 0046)
    ERROR = "error"  # it could not be reached


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    REFUSED = "refused"
    DROPPED = "dropped"


# -- events ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Committee:
    """The committee a delta on this base goes to now: at the start, at each view (change) and
    before each pass the runtime knows of. While no delivery is under way, a committee with a
    member not asked yet, none of it holding or refusing the delta, starts a new delivery."""

    members: tuple[str, ...]


@dataclass(frozen=True)
class Answer:
    """A member's answer to an upload: ``status`` "accepted", "rejected" or "error" (could not
    be reached), with its code and fast-forward hint."""

    peer: str
    status: str
    code: Reason | None = None
    hint: int | None = None


@dataclass(frozen=True)
class Timer:
    """The time a :class:`Wait` named has come."""


@dataclass(frozen=True)
class Settled:
    """A certificate above the delta's base applied (merged or not, the delta is settled), or
    the learner no longer waits for it: nothing more is sent or told."""


@dataclass(frozen=True)
class Receipt:
    """A holder's answer to a receipt poll: whether it dropped the delta, and why."""

    peer: str
    dropped: bool
    code: Reason | None = None


@dataclass(frozen=True)
class ReceiptDue:
    """Time to ask the holders whether they still hold the delta (the runtime polls while it is
    in flight; the simulator's members say so as they drop it)."""


DeliveryEvent = Committee | Answer | Timer | Settled | ReceiptDue | Receipt


# -- effects --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Upload the delta to each of ``peers`` now (asking it to relay); answer each one with an
    :class:`Answer`."""

    peers: tuple[str, ...]


@dataclass(frozen=True)
class Wait:
    """Feed :class:`Timer` at ``until``."""

    until: float


@dataclass(frozen=True)
class Tell:
    """A message to the trainer, at most one a delta (``dropped`` may follow ``accepted``)."""

    verdict: Verdict
    code: Reason | None = None
    hint: int | None = None  # the highest fast-forward hint the refusals carried


@dataclass(frozen=True)
class Pause:
    """The node's pause reason: no member of the committee can be reached (retrying in
    ``retry_in`` seconds), or None when that no longer holds."""

    retry_in: float | None

    @property
    def reason(self) -> str | None:
        if self.retry_in is None:
            return None
        return f"no syncer reachable, retrying in {self.retry_in:.0f} s"


@dataclass(frozen=True)
class PollReceipt:
    """Ask these holders whether they still hold the delta; answer each with :class:`Receipt`."""

    peers: tuple[str, ...]


DeliveryEffect = Send | Wait | Tell | Pause | PollReceipt


# -- the choice of members (pure) ------------------------------------------------------------


def intake_order(digest: str, members: Sequence[str], me: str) -> list[str]:
    """The members in the order this delta tries them: the learner itself first when it is a
    member (its own syncer takes it without an upload), then by SHA-256 of digest and member."""

    def rank(member: str) -> bytes:
        return hashlib.sha256(f"{digest}/{member}".encode()).digest()

    others = sorted((m for m in members if m != me), key=rank)
    return [me, *others] if me in members else others


def fetch_order(digest: str, members: Sequence[str], me: str, proposer: str) -> list[str]:
    """Whom a member asks for agreed input ``digest`` it lacks (ADR 0037): first the fellow its
    learner most likely uploaded it to (the first of :func:`intake_order` for a learner off the
    committee, ``me`` left out: it lacks the input), which relayed it and so holds it, then the
    proposer, which holds every input it proposed, then the others as learners try them. The
    fetches of a round so spread over the members' uplinks instead of all queueing on the
    proposer's."""
    ranked = [m for m in intake_order(digest, members, "") if m != me]
    first = ranked[:1] if ranked and ranked[0] != proposer else []
    return [*first, proposer, *(m for m in ranked if m not in first and m != proposer)]


def next_targets(
    order: Sequence[str], statuses: Mapping[str, str], retry: Sequence[str]
) -> list[str]:
    """Members to send to now (none: done). ``statuses`` holds each asked member's last
    answer ("accepted", "rejected", "busy": BUSY, or "error": unreachable); ``retry`` the
    members to ask again (they said "later" or BUSY, or could not be reached), the one asked
    longest ago first. Done once a member of ``order`` (the current committee) holds the delta
    or refused it, or every member is unreachable and none is left to retry."""
    if any(statuses.get(m) == "accepted" for m in order):
        return []
    if any(statuses.get(m) == "rejected" and m not in retry for m in order):
        return []  # refused by a member of this view: the others would say the same
    waiting = [m for m in retry if m in order]
    if any(statuses.get(m) in ("error", "busy") for m in waiting) or not waiting:
        fresh = [m for m in order if m not in statuses]
        if fresh:  # the next member at once: the one asked cannot be reached, or is busy
            return fresh[:1]
        if waiting and all(statuses.get(m) == "busy" for m in waiting):
            return waiting[:1]  # every member busy: one at a time, never two uploads at once
    return waiting


# -- the machine ----------------------------------------------------------------------------


@dataclass
class Delivery:
    """Everything about delivering the delta ``digest`` from learner ``me``: whom to send it to,
    when, and what to tell the trainer. Feed :meth:`handle` events in time order; carry out the
    effects it returns in order. ``order`` is the delta's order over the latest committee."""

    digest: str
    me: str
    max_passes: int = MAX_PASSES
    order: list[str] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)  # member → its latest answer
    retry: list[str] = field(default_factory=list)  # to ask again, the one asked longest ago first
    codes: list[Reason] = field(default_factory=list)  # refusals, in order
    hint: int | None = None
    told: Verdict | None = None
    running: bool = False  # a delivery is under way (its passes, their back-offs)
    done: bool = False  # settled or dropped: no effect any more
    passes: int = 0  # of the delivery under way
    backoff: float = RETRY
    outstanding: set[str] = field(default_factory=set)  # sent to, not answered yet
    replies: list[Answer] = field(default_factory=list)  # answers of the pass under way
    queued: tuple[str, ...] = ()  # sent to when the Wait ends
    waiting_until: float | None = None
    paused: float | None = None
    dropped_by: dict[str, Reason] = field(default_factory=dict)

    @property
    def holders(self) -> tuple[str, ...]:
        """Members that accepted the delta from this learner."""
        return tuple(m for m, s in self.statuses.items() if s == Status.ACCEPTED.value)

    def handle(self, event: DeliveryEvent, now: float) -> list[DeliveryEffect]:
        if self.done:
            return []
        if isinstance(event, Committee):
            return self._committee(event.members, now)
        if isinstance(event, Answer):
            return self._answer(event, now)
        if isinstance(event, Timer):
            return self._timer(now)
        if isinstance(event, Receipt):
            return self._receipt(event)
        if isinstance(event, ReceiptDue):
            return [PollReceipt(self.holders)] if self.holders else []
        self.done, self.running = True, False
        return self._unpause()

    # -- events ----------------------------------------------------------------------------

    def _committee(self, members: Sequence[str], now: float) -> list[DeliveryEffect]:
        self.order = intake_order(self.digest, members, self.me)
        if self.running:
            return []  # the next pass takes it
        if not next_targets(self.order, self.statuses, []):
            return []
        self.running, self.passes, self.backoff, self.retry = True, 0, RETRY, []
        return self._pass(now)

    def _answer(self, a: Answer, now: float) -> list[DeliveryEffect]:
        if a.peer not in self.outstanding:
            return []
        self.outstanding.discard(a.peer)
        self.replies.append(a)
        busy = a.status == "rejected" and a.code is Reason.BUSY  # another member may not be
        self.statuses[a.peer] = Status.BUSY.value if busy else a.status
        out: list[DeliveryEffect] = []
        if a.status != "accepted" and (a.code in RETRYABLE or a.status == "error"):
            self.retry.append(a.peer)
        elif a.status == "rejected":
            self.codes.append(a.code or Reason.MALFORMED)
            self.hint = max(self.hint or 0, a.hint) if a.hint is not None else self.hint
        elif a.status == "accepted" and self.told is None:
            self.told = Verdict.ACCEPTED
            out.append(Tell(Verdict.ACCEPTED, None, self.hint))
        if not self.outstanding:
            out += self._passed(now)
        return out

    def _timer(self, now: float) -> list[DeliveryEffect]:
        if self.waiting_until is None or now < self.waiting_until:
            return []
        self.waiting_until = None
        return self._send(self.queued)

    def _receipt(self, r: Receipt) -> list[DeliveryEffect]:
        if not r.dropped or r.peer not in self.holders:
            return []
        self.dropped_by[r.peer] = r.code or Reason.MALFORMED
        holders = self.holders
        if any(h not in self.dropped_by for h in holders):
            return []
        self.done, self.running = True, False
        return [*self._unpause(), Tell(Verdict.DROPPED, self.dropped_by[holders[0]])]

    # -- passes ----------------------------------------------------------------------------

    def _passed(self, now: float) -> list[DeliveryEffect]:
        """Every answer of a pass is in: the pause reason, the back-off, the next pass."""
        replies, self.replies = self.replies, []
        self.passes += 1
        # None reachable: every member asked could not be reached, and none is left to try.
        unreachable = all(s == Status.ERROR.value for s in self.statuses.values()) and all(
            m in self.statuses for m in self.order
        )
        gone = all(a.status == "error" for a in replies)  # only unreachable ones left to ask
        if gone:
            self.backoff = min(
                2 * self.backoff, UNREACHABLE_BACKOFF if unreachable else MAX_BACKOFF
            )
        else:
            self.backoff = RETRY
        out: list[DeliveryEffect] = []
        if (self.backoff if unreachable else None) != self.paused:
            self.paused = self.backoff if unreachable else None
            out.append(Pause(self.paused))
        return out + self._pass(now)

    def _pass(self, now: float) -> list[DeliveryEffect]:
        targets = next_targets(self.order, self.statuses, self.retry)
        if not targets or self.passes >= self.max_passes:
            return self._end()
        if any(t in self.statuses for t in targets):  # asking again: not at once
            self.queued = tuple(targets)
            self.waiting_until = now + self.backoff
            return [Wait(self.waiting_until)]
        return self._send(tuple(targets))

    def _send(self, targets: tuple[str, ...]) -> list[DeliveryEffect]:
        self.retry = [m for m in self.retry if m not in targets]
        self.outstanding.update(targets)
        return [Send(targets)]

    def _end(self) -> list[DeliveryEffect]:
        """The delivery under way ends: held, refused (told once; a later view's committee is
        still offered it, which may take a delta that came late for this one), or out of
        passes."""
        self.running = False
        out = self._unpause()
        if self.told is None and self.codes:
            self.told = Verdict.REFUSED
            out.append(Tell(Verdict.REFUSED, self.codes[0], self.hint))
        return out

    def _unpause(self) -> list[DeliveryEffect]:
        if self.paused is None:
            return []
        self.paused = None
        return [Pause(None)]
