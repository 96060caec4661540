"""What one node decides around its ``SyncerRound`` as a (possible) committee member, sans-IO.

Every node runs one ``SyncerNode``: the runtime's syncer service (``sync/service.py``) and each
simulated peer (``sim/syncer.py``) drive the same one. It holds what outlives one round:

- the **held** submissions: digest → the ``Submission`` and what the interpreter keeps with it
  (``data``: the signed bytes and payload it serves and merges in the runtime, who sent it in
  the simulator). A submission is held exactly while its round has it accepted (``Dropped``
  forgets it); a copy of a held one is answered "accepted" again, so a resend whose first
  reply was lost, or a learner's own copy after a fellow's relay, is idempotent.
- the digests **seen** (``ReplayGuard``): a later copy of one a round judged is a replay; one
  refused with a code asking for a retry (``RETRYABLE``) is not seen.
- the **fast-forward** hints the round gave stale learners (``FastForward``), told with the
  refusal; bounded by ``MAX_FAST_FORWARD_KEPT``.
- the **buffered** early committee messages (a proposal or signature for a round this node has
  not opened, up to ``EARLY_VERSIONS`` versions ahead, ``MAX_BUFFERED`` of them), handed back by
  ``install`` once their version's round may exist.
- the adaptive **arrivals** window (``ArrivalWindow``) that sets each round's ``close_after``.

and decides, for each view of the next version (``core/views.py`` says which view it is in):

- ``open_view``: whether the node sits on the view's committee; if a timeout certificate locked
  the content (ADR 0012) but this node has not heard the lock's input set, it waits
  (``Seating.WAITING``); otherwise it opens the view's round (the interpreter builds its
  ``RoundParams``) and **carries** into it what it held in the view before (same base version;
  a locked round takes only the lock's inputs), then names the locked inputs still missing and
  the voters that signed the lock, who hold them (``FetchLocked``).
- ``on_submission``: the verdict a submitter hears (``Verdict``) and the round's actions; with
  no round open, NO_OPEN_ROUND when the node sits on one of the next views' committees (a
  retry will find it there) and NOT_ON_COMMITTEE otherwise, with a fast-forward hint for a
  base older than the certified version; a learner's own delta it would pass on is refused
  BUSY while the interpreter's ``busy`` says its relays would outlast the round's collecting
  (ADR 0034); an accepted one is passed on (``Verdict.relay``) while the round is undecided.
- ``vote_due``: the view driver's decision (``core/views.py: leave_view``).

Nothing here touches the network, the clock or tensors: time comes in as ``now``, effects go
out as values. Memory is bounded: held by the round's ``max_inputs``, seen by ``ReplayGuard``,
hints and buffered messages by the caps below.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from p2pdiloco.core.arrivals import ArrivalWindow
from p2pdiloco.core.bounded import ReplayGuard
from p2pdiloco.core.roster import CommitteeInfo
from p2pdiloco.core.round import (
    Action,
    Clipped,
    Dropped,
    FastForward,
    Refusal,
    Reject,
    RoundParams,
    Submission,
    SyncerRound,
)
from p2pdiloco.core.views import Seat, ViewState, VoteIntent, leave_view
from p2pdiloco.protocol.certificates import Certificate
from p2pdiloco.protocol.reasons import RETRYABLE, Reason
from p2pdiloco.protocol.records import RunManifest

T = TypeVar("T")  # what the interpreter keeps with a held submission
E = TypeVar("E")  # an early committee message, as the interpreter keeps it

MAX_BUFFERED = 256  # early proposals/signatures kept for a round this node has not opened
EARLY_VERSIONS = 2  # how far past the next version an early message is kept (v + 2 … v + 3)
MAX_FAST_FORWARD_KEPT = 4096

# Builds the round of a view from its committee, its locked input set and the close_after of
# the arrivals window: the interpreter's (it knows the live learners and the base's trust).
ParamsFor = Callable[[CommitteeInfo, tuple[str, ...] | None, float], RoundParams]


@dataclass
class Held(Generic[T]):
    sub: Submission
    data: T


@dataclass(frozen=True)
class Verdict:
    """What a submitter hears; ``relay``: the interpreter passes the submission on to the
    node's fellows (accepted from its own learner while the round is undecided)."""

    accepted: bool
    code: Reason | None = None
    reason: str = ""
    fast_forward: int | None = None
    clipped: bool = False  # counted with a smaller claim than signed (``Clipped``)
    relay: bool = False


_ACCEPTED = Verdict(True)  # immutable: one instance serves every plain acceptance


@dataclass(frozen=True)
class FetchLocked:
    """Fetch these inputs of the locked content, asking ``holders`` (the voters that signed
    it, who hold them) in turn."""

    digests: tuple[str, ...]
    holders: tuple[str, ...]


class Seating(enum.Enum):
    OFF = "off"  # not on this view's committee: serves what it holds, opens nothing
    WAITING = "waiting"  # locked on content whose input set this node has not heard
    MEMBER = "member"  # the view's round is open here


@dataclass(frozen=True)
class Opening:
    """What ``open_view`` did: where the node sits, what the round answered to each carried
    submission (digest, actions), and the locked inputs to fetch (None: nothing to fetch)."""

    seating: Seating
    seat: Seat
    carried: tuple[tuple[Submission, tuple[Action, ...]], ...] = ()
    fetch: FetchLocked | None = None


@dataclass
class SyncerNode(Generic[T, E]):
    """One node's committee duty across views and versions; see the module docstring."""

    me: str
    run_id: str
    manifest: RunManifest
    views: ViewState | None = None  # the views of the next version (None before ``install``)
    round: SyncerRound | None = None  # this view's round, when the node sits on its committee
    committee: CommitteeInfo | None = None  # this view's committee
    held: dict[str, Held[T]] = field(default_factory=dict)  # bounded by the round's max_inputs
    fast_forward: dict[str, int] = field(default_factory=dict)  # learner → version to fetch
    buffered: list[tuple[int, E]] = field(default_factory=list)  # (version, early message)
    seen: ReplayGuard = field(init=False)
    arrivals: ArrivalWindow = field(init=False)

    def __post_init__(self) -> None:
        rules = self.manifest.rules
        self.seen = ReplayGuard.for_staleness(rules.staleness)
        self.arrivals = ArrivalWindow(rules.grace, rules.grace_min)

    @property
    def version(self) -> int | None:
        """The certified version this node builds on (None before ``install``)."""
        return self.views.version - 1 if self.views is not None else None

    @property
    def view(self) -> int:
        return self.views.view if self.views is not None else 0

    # -- versions and views ----------------------------------------------------------------

    def install(
        self,
        base: Certificate | None,
        version: int,
        now: float,
        views: ViewState | None = None,
    ) -> list[E] | None:
        """A newly certified (or genesis, or downloaded) ``version`` with its certificate
        ``base``: a new ``ViewState`` in view 0 (``views``: one pooled over the network, the
        simulator's); what the node held, its hints and its round are over. Returns the buffered early messages now due (for the round of
        ``version + 1``), to be handled again; None if ``version`` is not newer than the one
        installed. The caller then calls ``open_view``."""
        if self.version is not None and version <= self.version:
            return None
        self.views = views or ViewState(self.run_id, self.manifest, base, self.me, now)
        self.seen.advance(version)
        self.held.clear()
        self.fast_forward.clear()
        early = [msg for v, msg in self.buffered if v == version + 1]
        self.buffered = [(v, msg) for v, msg in self.buffered if v > version + 1]
        return early

    def open_view(self, params_for: ParamsFor, now: float, seat: Seat | None = None) -> Opening:
        """Open the round of the node's current view (``seat``: the view as the interpreter
        resolved it, by default ``views.seat()``). Off the committee, or waiting for a lock's
        inputs, it opens nothing and keeps what it holds: a later view may carry it."""
        assert self.views is not None
        seat = self.views.seat() if seat is None else seat
        self.committee, self.round = seat.committee, None
        if self.me not in seat.committee.members:
            return Opening(Seating.OFF, seat)
        if seat.lock is not None and seat.locked is None:
            return Opening(Seating.WAITING, seat)
        params = params_for(seat.committee, seat.locked, self.arrivals.next_round())
        self.round = rnd = SyncerRound(params, self.me)
        carry, self.held = list(self.held.values()), {}
        carried: list[tuple[Submission, tuple[Action, ...]]] = []
        for held in carry:
            d = held.sub.digest
            if seat.locked is not None and d not in seat.locked:
                continue
            actions = rnd.on_submission(held.sub, now)
            self._track(actions)
            if d in rnd.accepted:
                self.held[d] = held
            carried.append((held.sub, tuple(actions)))
        missing = tuple(d for d in seat.locked or () if d not in rnd.accepted)
        holders = tuple(h for h in seat.holders if h != self.me)
        fetch = FetchLocked(missing, holders) if missing else None
        return Opening(Seating.MEMBER, seat, tuple(carried), fetch)

    def on_proposal(
        self,
        signer: str,
        version: int,
        view: int,
        digests: tuple[str, ...],
        attempt: int,
        now: float,
    ) -> tuple[Refusal | None, list[Action], bool]:
        """A leader's verified proposal (``version``, ``view``): the refusal its sender hears
        (None: taken), the round's actions, and whether this node adopted the set just now, so
        passes the proposal on to its fellows (the leader may be gone, ADR 0042). One for a later
        view is refused NO_OPEN_ROUND (retry once this node is in it), an earlier one
        ROUND_CLOSED."""
        rnd, current = self.round, self.version
        if rnd is None or current is None or version != current + 1:
            return (Reason.NO_OPEN_ROUND, f"no open round for version {version}"), [], False
        if view != self.view:
            code = Reason.NO_OPEN_ROUND if view > self.view else Reason.ROUND_CLOSED
            return (code, f"proposal for view {view}; this syncer is in {self.view}"), [], False
        fresh = rnd.input_set is None
        actions = self.track(rnd.on_proposal(signer, digests, now, attempt))
        refused = _refusal_of(actions, signer)
        refusal = (refused.code, refused.reason) if refused is not None else None
        return refusal, actions, fresh and rnd.input_set is not None

    def vote_due(self, now: float) -> VoteIntent | None:
        """The node should vote to leave its view now (``leave_view``): what to vote and to
        whom. The round, if any, has then abandoned the view (it signs nothing more)."""
        return leave_view(self.views, self.round, now) if self.views is not None else None

    def buffer_if_early(self, version: int, message: E) -> bool:
        """Keep a committee message for a round a few versions ahead (this node may still be
        catching up); True if kept."""
        current = self.version if self.version is not None else -1
        early = current + 1 < version <= current + 1 + EARLY_VERSIONS
        if early and len(self.buffered) < MAX_BUFFERED:
            self.buffered.append((version, message))
            return True
        return False

    # -- submissions -----------------------------------------------------------------------

    def on_submission(
        self,
        sub: Submission,
        data: T,
        now: float,
        *,
        pass_on: bool = False,
        busy: Callable[[SyncerRound], str | None] | None = None,
    ) -> tuple[Verdict, list[Action]]:
        """A submission whose signature and payload the interpreter checked (``data``: what it
        keeps with it). ``pass_on``: it came straight from its learner, asking this node to
        relay it; ``busy``: why the relays queued here refuse one more now (None: take it)."""
        digest = sub.digest
        if digest in self.held:
            return _ACCEPTED, []
        rnd, views = self.round, self.views
        if rnd is None or views is None:
            version = self.version
            later = views is not None and views.member_soon()
            code = Reason.NO_OPEN_ROUND if later else Reason.NOT_ON_COMMITTEE  # later: retry
            text = f"not on the committee of this view of version {(version or 0) + 1}"
            ff = version if version is not None and sub.base_version < version else None
            return Verdict(False, code, text, fast_forward=ff), []
        relaying = pass_on and rnd.undecided
        if relaying and busy is not None and (why := busy(rnd)) is not None:
            return Verdict(False, Reason.BUSY, why), []
        actions = rnd.on_submission(sub, now)
        # Most submissions are taken quietly (no action): the checks below are for the rest.
        refused = _refusal_of(actions, sub.peer_id) if actions else None
        if actions:
            self._track(actions)
        if refused is None or refused.code not in RETRYABLE:
            self.seen.add(digest, sub.base_version)
        if digest in rnd.accepted:
            self.held[digest] = Held(sub, data)
        if refused is not None:
            hint = self.fast_forward.pop(sub.peer_id, None)
            return Verdict(False, refused.code, refused.reason, fast_forward=hint), actions
        self.arrivals.arrived(now - rnd.params.opened_at)
        clipped = bool(actions) and any(isinstance(a, Clipped) for a in actions)
        if not clipped and not relaying:
            return _ACCEPTED, actions
        return Verdict(True, clipped=clipped, relay=relaying), actions

    def resent(self, digest: str) -> Verdict | None:
        """A copy of a submission this node holds: "accepted" again (None: not held). The
        interpreter asks before checking a submission's signature and payload."""
        return _ACCEPTED if digest in self.held else None

    def on_fetched(self, sub: Submission, data: T) -> list[Action]:
        """An agreed input fetched from a fellow (or a lock's holder), checked as a learner's."""
        if self.round is None:
            return []
        self.seen.add(sub.digest, sub.base_version)
        actions = self.round.on_fetched(sub)
        self._track(actions)
        if sub.digest in self.round.accepted:
            self.held.setdefault(sub.digest, Held(sub, data))
        return actions

    def track(self, actions: list[Action]) -> list[Action]:
        """``actions``, which the interpreter got from the round directly (a proposal, a
        merge's outcome, a signature, a tick), once the node's state is in step with them."""
        self._track(actions)
        return actions

    def _track(self, actions: Iterable[Action]) -> None:
        for a in actions:
            if isinstance(a, Dropped):
                for d in a.digests:
                    self.held.pop(d, None)
            elif isinstance(a, FastForward) and len(self.fast_forward) < MAX_FAST_FORWARD_KEPT:
                self.fast_forward[a.peer_id] = a.to_version


def _refusal_of(actions: Iterable[Action], peer_id: str) -> Reject | None:
    """The round's refusal of what ``peer_id`` sent (a ``Reject`` may name another peer: one
    evicted to make room)."""
    return next((a for a in actions if isinstance(a, Reject) and a.peer_id == peer_id), None)
