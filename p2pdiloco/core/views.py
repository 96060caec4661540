"""Which view of the next version's round this node is in, as a sans-IO machine.

One ``ViewState`` lives per certified base version, on every node (any node may sit on a later
view's committee). It never touches the network or the clock: the driver feeds it time and
verified votes and asks it what to do.

- ``due(now)``: this node sits on the current view's committee, has not voted in it, and the
  view has been open for the manifest's ``view_timeout``: time to vote (``sign_vote``) and stop
  signing in that view; the driver then ``cast``s the vote and sends it to ``recipients``.
- ``add(vote, now, body)``: a verified vote from a member of the view it names, with the body
  it signed (if any). Once the votes of the current view form a timeout certificate
  (``view_change.timeout_lock``), the state moves to the next view (possibly several, if later
  votes are already in) and returns True: the driver opens the round of the new view if this
  node sits on its committee. A TC with a lock fixes the content every later view certifies:
  ``locked_inputs`` is that content's input set (its accepted and screened-out digests), and
  ``holders`` the voters that signed it (they hold the submissions).
- ``adopt(tcs, now, lock_body)``: timeout certificates a vote message carries (with the body of
  their lock), so a node that missed the votes of an earlier view catches up on them first.

Views are numbered 0 … MAX_VIEWS − 1; the last view never times out (there is nothing to hand
over to), it waits for its certificate or for the run to be restarted by its members.

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
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.view_change import (
    MAX_VIEWS,
    TimeoutCert,
    ViewVote,
    timeout_cert_of,
    timeout_lock,
)


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
    round signed in it, None: nothing), sent to ``recipients``. The driver names the content of
    that state (its certificate body), signs the vote and ``cast``s it."""

    version: int
    view: int
    signed: str | None
    recipients: tuple[str, ...]


@dataclass
class ViewState:
    run_id: str
    manifest: RunManifest
    base: Certificate | None  # the certified version v; the views are those of v + 1
    me: str
    opened_at: float  # when this node entered ``view``
    view: int = 0
    tcs: list[TimeoutCert] = field(default_factory=list)  # proofs for views 0 … view − 1
    votes: dict[int, dict[str, ViewVote]] = field(default_factory=dict)  # view → voter → vote
    voted: set[int] = field(default_factory=set)
    lock: str | None = None  # the content every later view must certify (view_change)
    bodies: dict[str, CertificateBody] = field(default_factory=dict)  # content → a body of it
    signers: dict[str, set[str]] = field(default_factory=dict)  # content → voters that signed it
    _committees: dict[int, CommitteeInfo] = field(default_factory=dict)
    started: float = field(init=False)  # when view 0 opened here

    def __post_init__(self) -> None:
        self.started = self.opened_at

    def expected_view(self, now: float) -> int:
        """The view a node that hears no votes (a learner off the committees) should expect:
        the one it knows, or one more per ``view_timeout`` elapsed since view 0 opened."""
        guessed = int((now - self.started) // self.manifest.rules.view_timeout_s)
        return min(MAX_VIEWS - 1, max(self.view, guessed))

    @property
    def version(self) -> int:
        return (self.base.body.version if self.base is not None else 0) + 1

    def committee(self, view: int | None = None) -> CommitteeInfo:
        j = self.view if view is None else view
        if j not in self._committees:
            self._committees[j] = committee_for(self.run_id, self.manifest, self.base, j)
        return self._committees[j]

    def member(self, view: int | None = None) -> bool:
        return self.me in self.committee(view).members

    def member_soon(self, ahead: int = 2) -> bool:
        """True if this node sits on the committee of one of the next ``ahead`` views: a
        submission that reaches it early should be sent again, not dropped."""
        last = min(self.view + ahead, MAX_VIEWS - 1)
        return any(self.member(j) for j in range(self.view + 1, last + 1))

    def due(
        self, now: float, leader_silent: bool = False, voter: str | None = None, voted: bool = False
    ) -> bool:
        """True when this member should vote to leave the current view: it has been open for
        ``view_timeout`` without a certificate, or (``leader_silent``) the round closed and
        its leader proposed nothing within ``agree_timeout``, or the round's quorum is out of
        reach (``SyncerRound.quorum_unreachable``, ADR 0041). ``voter``: another member, of a
        state pooled over the network (the simulator's), which has ``voted`` in this view or
        not; this node's own votes are in ``self.voted``."""
        timed_out = now >= self.opened_at + self.manifest.rules.view_timeout_s
        if voter is None:
            voted, member = self.view in self.voted, self.member()
        else:
            member = voter in self.committee().members
        return self.view + 1 < MAX_VIEWS and not voted and member and (timed_out or leader_silent)

    def cast(self, vote: ViewVote, now: float, body: CertificateBody | None = None) -> bool:
        """Record this node's own vote (the driver signed it, over ``body``'s content if it
        signed one); True if the view moved on."""
        self.voted.add(vote.view)
        return self.add(vote, now, body)

    def recipients(self, view: int) -> list[str]:
        """Who hears a vote of ``view``: that view's committee and the next one's."""
        peers = list(self.committee(view).members)
        if view + 1 < MAX_VIEWS:
            peers += [p for p in self.committee(view + 1).members if p not in peers]
        return [p for p in peers if p != self.me]

    def add(self, vote: ViewVote, now: float, body: CertificateBody | None = None) -> bool:
        """A vote whose signature the driver verified, with the body it signed (kept if its
        content is the one voted). Ignored unless it is for this version, for the current view
        or a later one, and from a member of the committee it names. Bounded: one vote per
        member per view, views below MAX_VIEWS, one body per voted content."""
        if (
            vote.run != self.run_id
            or vote.version != self.version
            or not self.view <= vote.view < MAX_VIEWS
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
        """Timeout certificates of earlier views (carried by a vote message) and the body of
        their lock: each valid one for the current view moves this node on. True if it moved.
        The body is kept only if it is the proven lock's (so a sender cannot fill memory)."""
        moved = False
        for tc in tcs:
            if tc.view == self.view and self.view + 1 < MAX_VIEWS and self._try(tc, now):
                moved = True
                for v in tc.votes:
                    if v.signed is not None:
                        self.signers.setdefault(v.signed, set()).add(v.voter)
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
        moved = False
        while self.view + 1 < MAX_VIEWS:
            if not self._try(timeout_cert_of(self.view, self.votes.get(self.view, {})), now):
                break
            moved = True
        return moved

    def _try(self, tc: TimeoutCert, now: float) -> bool:
        """Enter the next view if ``tc`` is a timeout certificate of the current one whose lock
        agrees with the lock so far."""
        info = self.committee(tc.view)
        ok, locked = timeout_lock(tc, info.members, info.quorum)
        if not ok or (locked is not None and self.lock is not None and locked != self.lock):
            return False
        self.lock = self.lock or locked
        self.tcs.append(tc)
        self.votes.pop(tc.view, None)
        self.view += 1
        self.opened_at = now
        return True


def leave_view(
    st: ViewState,
    rnd: SyncerRound | None,
    now: float,
    voter: str | None = None,
    voted: bool = False,
) -> VoteIntent | None:
    """Whether member ``voter`` (None: ``st.me``; else it has ``voted`` in this view or not),
    whose round of the current view is ``rnd``, votes to leave it now (``ViewState.due``: timed out, or its round stuck on a silent leader
    or an unreachable quorum), and over what: its round then abandons the view (it signs
    nothing more in it). The vote goes to the committees of this view and the next."""
    stuck = rnd is not None and (rnd.leader_silent(now) or rnd.quorum_unreachable(now))
    if not st.due(now, stuck, voter, voted):
        return None
    signed = rnd.abandon() if rnd is not None else None
    return VoteIntent(st.version, st.view, signed, tuple(st.recipients(st.view)))


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
