"""View change: signed timeout votes, and the timeout certificate that lets the next committee
take over a version its committee could not certify (docs/adr/0012-view-change.md,
docs/adr/0055-views-that-fit-the-live-network.md).

The committee of view j of version v + 1 (``core.roster.committee_for(..., view=j)``, a function
of the chain and j only) either certifies v + 1 or, once its members time out, *abandons* the
view: each member that gives up signs a :class:`ViewVote` naming the content
(``certificates.content_digest``) it signed in that view, if any, and the lock it held when it
voted (the content and the view of the timeout certificate that locked it, if any), and from
then on signs nothing more in it. Counting every member that did not vote as a possible signer
of anything, a set of n − s votes of the view's n members with quorum q is a **timeout
certificate** (TC) when

    s + MARGIN < q,   n − s ≥ min_votes(n, q),   and   #{C : s + signed(C) + MARGIN ≥ q} ≤ 1

``min_votes`` (ADR 0055) is at least f + 1 voters for the f = ⌊(n − 1)/3⌋ faulty members a
committee of n tolerates, and never one voter of a committee of two or more: a lone member
(a free rider) never ends a view by itself.

The TC's **lock** is that one content, if any (it may have been certified in view j, so every
later view must certify exactly it), else the lock its voters reported with the highest view
(they hold it from a TC of an earlier view; two different contents at that highest view mean
no earlier view certified anything, and the TC frees the next view). Why one TC suffices: if C
was certified in view a, every TC of view a locks C (at least q − s of its signers vote and
report C), so every node that moves past view a holds lock C with a view ≥ a; in a later view
those honest members sign only C, so no other content can be possible there, and every
voter reports C at a view ≥ a, so every TC of every view after a locks C again. A certificate
of view j > 0 therefore carries only the TC of view j − 1 and must certify its lock, whatever
the number of views (the certificate's size does not grow with the view). ``MARGIN`` is the
number of voters allowed to lie (sign and then vote "nothing", or report another lock): 0
here, a protocol constant, which tolerates crashed, slow, partitioned and silent members (free
riders that never sign or vote) but not equivocating ones (ADR 0011, ADR 0055).

Wire form of a TC (inside a certificate's ``"views"`` list, and in vote messages):
``{"view": j, "votes": {"<peer id>": {"signed": "<64 hex>" | null, "lock": [view, "<64 hex>"]
| null, "sig": "<128 hex>"}}}``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from p2pdiloco.protocol.identity import Identity, verify_hex
from p2pdiloco.protocol.signing import InvalidRecord, canonical_json, signing_message

VOTE_KIND = "view-vote"
# The largest view number on the wire: a bound on the integer, not an end of the view window
# (ADR 0055: views go on while members time out; at the shortest view timeout this is decades).
MAX_VIEW = 2**31 - 1
MARGIN = 0  # voters assumed able to lie about what they signed (see the module docstring)
_HEX64 = frozenset("0123456789abcdef")


@dataclass(frozen=True, order=True)
class Lock:
    """A content every later view must certify, and the view of the TC that locked it."""

    view: int
    content: str

    def wire(self) -> list[Any]:
        return [self.view, self.content]


@dataclass(frozen=True)
class ViewVote:
    """One member's signed statement: "I give up view ``view`` of ``version``; I signed
    ``signed`` in it (None: nothing), held ``lock`` when I voted (None: free), and will sign
    nothing more in it"."""

    run: str
    version: int  # the version the abandoned round would have certified (base + 1)
    view: int
    signed: str | None
    voter: str
    sig: str  # 128 lowercase hex over ``vote_message``
    lock: Lock | None = None

    def wire(self) -> dict[str, Any]:
        lock = self.lock.wire() if self.lock is not None else None
        return {"signed": self.signed, "lock": lock, "sig": self.sig}


def vote_message(
    run: str, version: int, view: int, signed: str | None, lock: Lock | None = None
) -> bytes:
    fields = {"run": run, "version": version, "view": view, "signed": signed}
    body = canonical_json({**fields, "lock": lock.wire() if lock is not None else None})
    return signing_message(VOTE_KIND, run, body)


def sign_vote(
    identity: Identity,
    run: str,
    version: int,
    view: int,
    signed: str | None,
    lock: Lock | None = None,
) -> ViewVote:
    sig = identity.sign(vote_message(run, version, view, signed, lock)).hex()
    return ViewVote(run, version, view, signed, identity.peer_id, sig, lock)


def _hex64(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


def _view_number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_VIEW


def _parse_lock(obj: object, view: int) -> Lock | None:
    if obj is None:
        return None
    if not isinstance(obj, list) or len(obj) != 2 or not _hex64(obj[1]):
        raise InvalidRecord("a view vote's 'lock' must be [view, 64-hex content] or null")
    if not _view_number(obj[0]) or obj[0] >= view:
        raise InvalidRecord(f"a vote of view {view} reports a lock of view {obj[0]!r}")
    return Lock(int(obj[0]), str(obj[1]))


def parse_vote(run: str, version: int, view: int, voter: object, obj: object) -> ViewVote:
    """A vote from its wire form, signature checked; InvalidRecord (one line) if it is not one."""
    keys = {"signed", "lock", "sig"}
    if not isinstance(voter, str) or not isinstance(obj, dict) or set(obj) != keys:
        raise InvalidRecord("a view vote must be {'signed': hash or null, 'lock', 'sig': hex}")
    signed, sig = obj["signed"], obj["sig"]
    if signed is not None and not _hex64(signed):
        raise InvalidRecord("a view vote's 'signed' must be a 64-hex state hash or null")
    if not _view_number(view):
        raise InvalidRecord(f"view {view!r} out of range (at most {MAX_VIEW})")
    lock = _parse_lock(obj["lock"], view)
    if not verify_hex(voter, vote_message(run, version, view, signed, lock), sig):
        raise InvalidRecord(f"view vote of {voter[-8:]} does not verify")
    return ViewVote(run, version, view, signed, voter, str(sig), lock)


@dataclass(frozen=True)
class TimeoutCert:
    """Verified votes for one view (signatures checked; membership and the bound are checked
    against that view's committee by :func:`timeout_lock`)."""

    view: int
    votes: tuple[ViewVote, ...]  # one per voter, sorted by voter

    def wire(self) -> dict[str, Any]:
        return {"view": self.view, "votes": {v.voter: v.wire() for v in self.votes}}


def parse_timeout_cert(run: str, version: int, obj: object) -> TimeoutCert:
    """A TC from its wire form; every vote must verify (InvalidRecord otherwise)."""
    if not isinstance(obj, dict) or set(obj) != {"view", "votes"}:
        raise InvalidRecord("a timeout certificate must be {'view': n, 'votes': {...}}")
    view, votes = obj["view"], obj["votes"]
    if not _view_number(view) or not isinstance(votes, dict):
        raise InvalidRecord("a timeout certificate's view must be an int and votes an object")
    if len(votes) > 64:
        raise InvalidRecord("a timeout certificate holds at most 64 votes")
    parsed = [parse_vote(run, version, view, voter, v) for voter, v in sorted(votes.items())]
    return TimeoutCert(view, tuple(parsed))


def min_votes(members: int, quorum: int) -> int:
    """The fewest votes of a view's ``members`` (quorum ``quorum``) that may end it: more than
    could block its quorum (members − quorum + MARGIN + 1: the silent could not certify), at
    least f + 1 for the f = ⌊(n − 1)/3⌋ faulty members n tolerates (one voter at least is
    correct: it timed out, or found the round stuck), and two for any committee of two or
    more (a lone vote never ends a view, ADR 0055)."""
    f = (members - 1) // 3
    return max(members - quorum + MARGIN + 1, f + 1, min(members, 2))


def timeout_lock(tc: TimeoutCert, members: Sequence[str], quorum: int) -> tuple[bool, str | None]:
    """Whether ``tc``'s votes from ``members`` prove that its view can certify nothing new, and
    the content every later view must certify (its *lock*), if any: :func:`tc_lock` without
    the view of the lock."""
    ok, lock = tc_lock(tc, members, quorum)
    return ok, lock.content if lock is not None else None


def tc_lock(tc: TimeoutCert, members: Sequence[str], quorum: int) -> tuple[bool, Lock | None]:
    """Whether ``tc``'s votes from ``members`` are a timeout certificate of its view, and its
    lock (None: the next view is free).

    With s members silent, a content voters signed n times could have reached the quorum in
    this view iff s + n + MARGIN ≥ quorum. The votes are a TC iff the silent alone could not
    certify (s + MARGIN < quorum), there are :func:`min_votes` of them, and at most one content
    could have been certified: that content is the lock (of this view). Else the lock is the
    one its voters reported with the highest view, if exactly one content has it. Returns
    (False, None) when the votes prove nothing yet.
    """
    if not members or quorum < 1:
        return False, None
    member_set = set(members)
    votes = [v for v in tc.votes if v.voter in member_set]
    silent = len(member_set) - len(votes)
    if silent + MARGIN >= quorum or len(votes) < min_votes(len(member_set), quorum):
        return False, None
    signed = Counter(v.signed for v in votes if v.signed is not None)
    possible = sorted(c for c, n in signed.items() if silent + n + MARGIN >= quorum)
    if len(possible) > 1:
        return False, None
    if possible:
        return True, Lock(tc.view, possible[0])
    reported = [v.lock for v in votes if v.lock is not None and v.lock.view < tc.view]
    if not reported:
        return True, None
    top = max(lock.view for lock in reported)
    highest = {lock.content for lock in reported if lock.view == top}
    return True, (Lock(top, highest.pop()) if len(highest) == 1 else None)


def timeout_cert_of(view: int, votes: Mapping[str, ViewVote]) -> TimeoutCert:
    """The TC made of ``votes`` (voter → vote) for ``view``."""
    return TimeoutCert(view, tuple(votes[k] for k in sorted(votes) if votes[k].view == view))
