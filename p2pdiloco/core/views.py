"""Which view of the next version's round this node is in, as a sans-IO machine.

One ``ViewState`` lives per certified base version, on every node (any node may sit on a later
view's committee). It never touches the network or the clock: the driver feeds it time and
verified votes and asks it what to do.

- ``due(now)``: this node sits on the current view's committee, has not voted in it, and the
  view has been open for its timeout (the pacemaker's ``view_timeout(rules, view)``): time to
  vote (``sign_vote``) and stop signing in that view; the driver then ``cast``s the vote and
  sends it to ``recipients``.
- ``add(vote, now, body)``: a verified vote from a member of the view it names, with the body
  it signed (if any). Once the votes of the current view (or of one a little ahead) form a
  timeout certificate (``view_change.tc_lock``), the state moves to the view after it and
  returns True: the driver opens the round of the new view if this node sits on its committee.
  The TC's lock (``lock_ref``: content and view) fixes the content every later view certifies:
  ``locked_inputs`` is that content's input set (its accepted and screened-out digests), and
  ``holders`` the voters that signed it (they hold the submissions).
- ``adopt(tcs, now, lock_body)``: timeout certificates a vote message carries (with the body of
  their lock), so a node that missed the votes of an earlier view catches up on them: one TC of
  any view at or after the current one moves it past that view (ADR 0055: the latest TC's lock
  is the lock of every earlier view).

**The pacemaker** (ADR 0055): view j's timeout is ``view_timeout × 2^j``, at most the
manifest's ``view_timeout_max``; a certificate starts the next version's views at view 0
again. The leader's ``agree_timeout`` grows by the same factor (``backoff``). A node that hears
no votes computes its view from the time since the base certificate alone (``view_at``, the
inverse of the sum of the timeouts), as every other node does from the same facts. Views have
no last one: they go on while members time out.

**Catching a fellow up** (``catch_up``): a member that was away (restarting) when the votes of
view j − 1 were sent never gets them: they are not sent again. It sits in view j − 1 while the
others are in view j, each refusing the other's proposals and signatures, until its own timeout
of view j − 1 (the soak saw 120 s, then a lock split across the two views and 490 s without a
certificate). So a member whose message of view j a fellow refuses for want of an open round
sends that fellow the TC that ended view j − 1, in a vote message (one of the TC's own votes),
and the fellow adopts it as any carried TC (``hear_vote``).

The view driver's decisions are here too, for the runtime (``sync/view_driver.py``, which signs
and sends) and the simulator (whose votes reach every node at once, so one ``ViewState`` pooled
over the network stands for each member's): ``leave_view`` says when a member votes, over what
and to whom (``VoteIntent``); ``hear_vote`` what a fellow's vote message changes; ``seat`` what
the current view asks of the ``SyncerNode`` (``core/syncer_node.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pdiloco.core.roster import CommitteeInfo, committee_for
from p2pdiloco.core.round import SyncerRound
from p2pdiloco.protocol.certificates import Certificate, CertificateBody, content_digest
from p2pdiloco.protocol.records import RunManifest, SyncRules
from p2pdiloco.protocol.view_change import (
    MAX_VIEW,
    Lock,
    TimeoutCert,
    ViewVote,
    tc_lock,
    timeout_cert_of,
)

# Views ahead of the current one whose votes a node keeps (a fellow's TC for a view further on
# arrives with its vote message): bounds the votes held at AHEAD × k.
AHEAD = 8


# -- the pacemaker ------------------------------------------------------------------------------


def backoff(rules: SyncRules, view: int) -> float:
    """How much longer than view 0 view ``view`` waits: 2^view, at most
    ``view_timeout_max / view_timeout``."""
    cap = rules.view_timeout_max_s / rules.view_timeout_s
    return min(2.0 ** min(view, 64), cap)


def view_timeout(rules: SyncRules, view: int) -> float:
    """Seconds view ``view`` stays open before its members vote to leave it."""
    return rules.view_timeout_s * backoff(rules, view)


def view_start(rules: SyncRules, view: int) -> float:
    """Seconds after view 0 opened at which view ``view`` opens if every view before it ran
    to its timeout: the sum of their timeouts."""
    total, j = 0.0, 0
    while j < view:
        t = view_timeout(rules, j)
        if view_timeout(rules, j + 1) <= t:  # at the bound: every later view lasts t
            return total + (view - j) * t
        total += t
        j += 1
    return total


def view_at(rules: SyncRules, elapsed: float) -> int:
    """The view a node that hears no votes is in ``elapsed`` seconds after view 0 opened: the
    last view whose :func:`view_start` is not after it (the timeouts double, then stay at the
    bound)."""
    j, start = 0, 0.0
    while True:
        t = view_timeout(rules, j)
        if start + t > elapsed:
            return j
        if view_timeout(rules, j + 1) <= t:  # at the bound: every later view lasts t
            return min(MAX_VIEW, j + 1 + int((elapsed - start - t) // t))
        start += t
        j += 1


@dataclass(frozen=True)
class Seat:
    """The current view as a ``SyncerNode`` opens it: its committee and what it is bound to."""

    version: int  # the version the view's round would certify
    view: int
    committee: CommitteeInfo
    lock: str | None  # the content earlier views locked (None: free)
    locked: tuple[str, ...] | None  # its input set (None while the lock's body is unheard)
    holders: tuple[str, ...]  # voters that signed the lock: they hold its inputs


@dataclass(frozen=True)
class VoteIntent:
    """Vote to leave ``view`` of ``version``: signed over ``signed`` (the state the member's
    round signed in it, None: nothing) and ``lock`` (the lock the node holds), sent to
    ``recipients``. The driver names the content of that state (its certificate body), signs
    the vote and ``cast``s it."""

    version: int
    view: int
    signed: str | None
    recipients: tuple[str, ...]
    lock: Lock | None = None


@dataclass
class ViewState:
    run_id: str
    manifest: RunManifest
    base: Certificate | None  # the certified version v; the views are those of v + 1
    me: str
    opened_at: float  # when this node entered ``view``
    view: int = 0
    tc: TimeoutCert | None = None  # the proof that view − 1 timed out (None in view 0)
    votes: dict[int, dict[str, ViewVote]] = field(default_factory=dict)  # view → voter → vote
    voted: set[int] = field(default_factory=set)
    lock_ref: Lock | None = None  # the content every later view must certify (view_change)
    bodies: dict[str, CertificateBody] = field(default_factory=dict)  # content → a body of it
    signers: dict[str, set[str]] = field(default_factory=dict)  # content → voters that signed it
    _committees: dict[int, CommitteeInfo] = field(default_factory=dict)
    started: float = field(init=False)  # when view 0 opened here

    def __post_init__(self) -> None:
        self.started = self.opened_at

    @property
    def lock(self) -> str | None:
        """The locked content (None: free)."""
        return self.lock_ref.content if self.lock_ref is not None else None

    @property
    def tcs(self) -> tuple[TimeoutCert, ...]:
        """What a certificate of the current view carries: the TC of the view before."""
        return (self.tc,) if self.tc is not None else ()

    def timeout(self, view: int | None = None) -> float:
        """The pacemaker's timeout of ``view`` (default: the current one)."""
        return view_timeout(self.manifest.rules, self.view if view is None else view)

    def expected_view(self, now: float) -> int:
        """The view a node that hears no votes (a learner off the committees) should expect:
        the one it knows, or the one the pacemaker reaches in the time since view 0 opened."""
        return max(self.view, view_at(self.manifest.rules, now - self.started))

    @property
    def version(self) -> int:
        return (self.base.body.version if self.base is not None else 0) + 1

    def committee(self, view: int | None = None) -> CommitteeInfo:
        j = self.view if view is None else view
        got = self._committees.get(j)
        if got is None:
            got = committee_for(self.run_id, self.manifest, self.base, j)
            if j <= self.view + AHEAD + 1:  # a learner's expected view may run far ahead
                self._committees[j] = got
        return got

    def member(self, view: int | None = None) -> bool:
        return self.me in self.committee(view).members

    def member_soon(self, ahead: int = 2) -> bool:
        """True if this node sits on the committee of one of the next ``ahead`` views: a
        submission that reaches it early should be sent again, not dropped."""
        return any(self.member(j) for j in range(self.view + 1, self.view + ahead + 1))

    def due(
        self, now: float, leader_silent: bool = False, voter: str | None = None, voted: bool = False
    ) -> bool:
        """True when this member should vote to leave the current view: it has been open for
        its timeout without a certificate, or (``leader_silent``) the round closed and its
        leader proposed nothing within its agree_timeout, or the round's quorum is out of
        reach (``SyncerRound.quorum_unreachable``, ADR 0041). ``voter``: another member, of a
        state pooled over the network (the simulator's), which has ``voted`` in this view or
        not; this node's own votes are in ``self.voted``."""
        timed_out = now >= self.opened_at + self.timeout()
        if voter is None:
            voted, member = self.view in self.voted, self.member()
        else:
            member = voter in self.committee().members
        return not voted and member and (timed_out or leader_silent)

    def cast(self, vote: ViewVote, now: float, body: CertificateBody | None = None) -> bool:
        """Record this node's own vote (the driver signed it, over ``body``'s content if it
        signed one); True if the view moved on."""
        self.voted.add(vote.view)
        return self.add(vote, now, body)

    def recipients(self, view: int) -> list[str]:
        """Who hears a vote of ``view``: that view's committee and the next one's."""
        peers = list(self.committee(view).members)
        peers += [p for p in self.committee(view + 1).members if p not in peers]
        return [p for p in peers if p != self.me]

    def add(self, vote: ViewVote, now: float, body: CertificateBody | None = None) -> bool:
        """A vote whose signature the driver verified, with the body it signed (kept if its
        content is the one voted). Ignored unless it is for this version, for the current view
        or one up to ``AHEAD`` later, and from a member of the committee it names. Bounded: one
        vote per member per view, ``AHEAD`` views, one body per voted content."""
        if (
            vote.run != self.run_id
            or vote.version != self.version
            or not self.view <= vote.view <= min(self.view + AHEAD, MAX_VIEW - 1)
            or vote.voter not in self.committee(vote.view).members
        ):
            return False
        self.votes.setdefault(vote.view, {}).setdefault(vote.voter, vote)
        if vote.signed is not None:
            self.signers.setdefault(vote.signed, set()).add(vote.voter)
            if body is not None and content_digest(body) == vote.signed:
                self.bodies.setdefault(vote.signed, body)
        return self._advance(now)

    def adopt(
        self, tcs: list[TimeoutCert], now: float, lock_body: CertificateBody | None = None
    ) -> bool:
        """Timeout certificates (carried by a vote message) and the body of their lock: the
        latest valid one of a view at or after the current one moves this node past it. True
        if it moved. The body is kept only if it is the proven lock's (so a sender cannot fill
        memory)."""
        moved = False
        for tc in sorted(tcs, key=lambda t: -t.view):
            if self.view <= tc.view < MAX_VIEW and self._try(tc, now):
                moved = True
                for v in tc.votes:
                    if v.signed is not None:
                        self.signers.setdefault(v.signed, set()).add(v.voter)
                break
        moved = self._advance(now) or moved
        lock = self.lock
        if lock is not None and lock_body is not None and content_digest(lock_body) == lock:
            self.bodies.setdefault(lock, lock_body)
        return moved

    def locked_inputs(self) -> tuple[str, ...] | None:
        """The input set of the locked content (None: free, or its body not known yet)."""
        body = self.bodies.get(self.lock) if self.lock is not None else None
        if body is None:
            return None
        return tuple(sorted({a.digest for a in body.accepted} | {r.digest for r in body.rejected}))

    def holders(self) -> list[str]:
        """Voters that signed the locked content: they hold its submissions."""
        return sorted(self.signers.get(self.lock, set())) if self.lock is not None else []

    def seat(self) -> Seat:
        """The current view, as a syncer node opens its round."""
        return Seat(
            self.version,
            self.view,
            self.committee(),
            self.lock,
            self.locked_inputs(),
            tuple(self.holders()),
        )

    def _advance(self, now: float) -> bool:
        """Move past the latest view whose held votes are a timeout certificate, if any."""
        for j in sorted(self.votes, reverse=True):
            if j >= self.view and self._try(timeout_cert_of(j, self.votes[j]), now):
                return True
        return False

    def _try(self, tc: TimeoutCert, now: float) -> bool:
        """Enter the view after ``tc``'s if it is a timeout certificate of that view (at or
        after the current one). Its lock replaces this node's: if a content was certified in
        an earlier view, every TC of a later view locks it again (``protocol.view_change``)."""
        info = self.committee(tc.view)
        ok, locked = tc_lock(tc, info.members, info.quorum)
        if not ok:
            return False
        self.lock_ref = locked
        if locked is not None:  # who signed it, or holds it from a later view, has its inputs
            c = locked.content
            got = self.signers.setdefault(c, set())
            got.update(
                v.voter for v in tc.votes if c == v.signed or (v.lock and v.lock.content == c)
            )
        self.tc = tc
        self.view = tc.view + 1
        self.opened_at = now
        self.votes = {j: v for j, v in self.votes.items() if j >= self.view}
        self.voted = {j for j in self.voted if j >= self.view}
        self._committees = {j: c for j, c in self._committees.items() if j >= self.view}
        kept = {v.signed for vs in self.votes.values() for v in vs.values()} | {self.lock}
        self.signers = {c: s for c, s in self.signers.items() if c in kept}
        self.bodies = {c: b for c, b in self.bodies.items() if c in kept}
        return True


@dataclass(frozen=True)
class CatchUp:
    """What brings a fellow that is behind into this node's view: a vote message made of
    ``vote`` (one of ``tc``'s votes, its signed ``body`` when it signed something) carrying
    ``tc``, the TC that ended the view before this node's, with the ``lock`` body."""

    vote: ViewVote
    tc: TimeoutCert
    body: CertificateBody | None
    lock: CertificateBody | None


def catch_up(st: ViewState) -> CatchUp | None:
    """For a fellow found in an earlier view of this version (it refused this node's proposal
    or signature for want of an open round): the TC of the view before this node's, in a vote
    message whose vote is one of the TC's own (one that signed nothing, else one that signed
    the lock, whose body this node holds). None in view 0, or when no such vote's body is
    known. Safe to send to anyone: the TC proves itself, and a node already past it, or on
    another version, ignores it."""
    tc = st.tc
    if tc is None:
        return None
    lock = st.bodies.get(st.lock) if st.lock is not None else None
    for vote in tc.votes:
        if vote.signed is None:
            return CatchUp(vote, tc, None, lock)
    for vote in tc.votes:
        body = st.bodies.get(vote.signed) if vote.signed is not None else None
        if body is not None:
            return CatchUp(vote, tc, body, lock)
    return None


def leave_view(
    st: ViewState,
    rnd: SyncerRound | None,
    now: float,
    voter: str | None = None,
    voted: bool = False,
) -> VoteIntent | None:
    """Whether member ``voter`` (None: ``st.me``; else it has ``voted`` in this view or not),
    whose round of the current view is ``rnd``, votes to leave it now (``ViewState.due``: timed
    out, or its round stuck on a silent leader or an unreachable quorum), and over what (the
    state its round signed, and the lock it holds): its round then abandons the view (it signs
    nothing more in it). The vote goes to the committees of this view and the next."""
    stuck = rnd is not None and (rnd.leader_silent(now) or rnd.quorum_unreachable(now))
    if not st.due(now, stuck, voter, voted):
        return None
    signed = rnd.abandon() if rnd is not None else None
    return VoteIntent(st.version, st.view, signed, tuple(st.recipients(st.view)), st.lock_ref)


def hear_vote(
    st: ViewState,
    vote: ViewVote,
    tcs: list[TimeoutCert],
    body: CertificateBody | None,
    lock: CertificateBody | None,
    now: float,
) -> bool:
    """A fellow's verified vote message (its vote, the TCs of earlier views it carries, the
    body it signed and the lock's body): True if this node moved to a later view. A vote for
    another version changes nothing."""
    if vote.version != st.version:
        return False
    moved = st.adopt(tcs, now, lock)
    return st.add(vote, now, body) or moved
