"""View change: signed timeout votes, and the timeout certificate that lets the next committee
take over a version its committee could not certify (docs/adr/0012-view-change.md).

The committee of view j of version v + 1 (``core.roster.committee_for(..., view=j)``) either
certifies v + 1 or, once its members time out, *abandons* the view: each member that gives up
signs a :class:`ViewVote` naming the content (``certificates.content_digest``) it signed in
that view, if any, and from then on signs nothing more in it. Counting every member that did
not vote as a possible signer of anything, a set of votes is a **timeout certificate** (TC)
when the silent members alone could not reach the quorum and at most one content could have:

    silent + MARGIN < quorum,   and   #{contents C : silent + signed(C) + MARGIN ≥ quorum} ≤ 1

That one content, if any, is the TC's **lock**: it may have been certified in view j, so every
later view of the version must certify exactly it (same state, receipts and roster; another
body, since the view and committee differ). A TC without a lock frees the next view. Honest
voters report what they signed, so a view that certified C yields only TCs locked on C, and a
certificate of view j carries the TCs of views 0 … j − 1: anyone checks from the chain alone
that no two certificates of one version certify different contents. ``MARGIN`` is the number of
voters allowed to lie (sign and then vote "nothing"): 0 here, a protocol constant, which
tolerates crashed, slow and partitioned members but not equivocating ones (ADR 0011).

Wire form of a TC (inside a certificate's ``"views"`` list, and in vote messages):
``{"view": j, "votes": {"<peer id>": {"signed": "<64 hex>" | null, "sig": "<128 hex>"}}}``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from p2pdiloco.protocol.identity import Identity, verify_hex
from p2pdiloco.protocol.signing import InvalidRecord, canonical_json, signing_message

VOTE_KIND = "view-vote"
MAX_VIEWS = 16  # views per version: a certificate carries at most MAX_VIEWS − 1 TCs
MARGIN = 0  # voters assumed able to lie about what they signed (see the module docstring)
_HEX64 = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class ViewVote:
    """One member's signed statement: "I give up view ``view`` of ``version``; I signed
    ``signed`` in it (None: nothing), and will sign nothing more in it"."""

    run: str
    version: int  # the version the abandoned round would have certified (base + 1)
    view: int
    signed: str | None
    voter: str
    sig: str  # 128 lowercase hex over ``vote_message``

    def wire(self) -> dict[str, Any]:
        return {"signed": self.signed, "sig": self.sig}


def vote_message(run: str, version: int, view: int, signed: str | None) -> bytes:
    body = canonical_json({"run": run, "version": version, "view": view, "signed": signed})
    return signing_message(VOTE_KIND, run, body)


def sign_vote(
    identity: Identity, run: str, version: int, view: int, signed: str | None
) -> ViewVote:
    sig = identity.sign(vote_message(run, version, view, signed)).hex()
    return ViewVote(run, version, view, signed, identity.peer_id, sig)


def _hex64(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


def parse_vote(run: str, version: int, view: int, voter: object, obj: object) -> ViewVote:
    """A vote from its wire form, signature checked; InvalidRecord (one line) if it is not one."""
    if not isinstance(voter, str) or not isinstance(obj, dict) or set(obj) != {"signed", "sig"}:
        raise InvalidRecord("a view vote must be {'signed': hash or null, 'sig': hex}")
    signed, sig = obj["signed"], obj["sig"]
    if signed is not None and not _hex64(signed):
        raise InvalidRecord("a view vote's 'signed' must be a 64-hex state hash or null")
    if not 0 <= view < MAX_VIEWS:
        raise InvalidRecord(f"view {view} out of range (at most {MAX_VIEWS - 1})")
    if not verify_hex(voter, vote_message(run, version, view, signed), sig):
        raise InvalidRecord(f"view vote of {voter[-8:]} does not verify")
    return ViewVote(run, version, view, signed, voter, str(sig))


@dataclass(frozen=True)
class TimeoutCert:
    """Verified votes for one view (signatures checked; membership and the bound are checked
    against that view's committee by :func:`proves_timeout`)."""

    view: int
    votes: tuple[ViewVote, ...]  # one per voter, sorted by voter

    def wire(self) -> dict[str, Any]:
        return {"view": self.view, "votes": {v.voter: v.wire() for v in self.votes}}


def parse_timeout_cert(run: str, version: int, obj: object) -> TimeoutCert:
    """A TC from its wire form; every vote must verify (InvalidRecord otherwise)."""
    if not isinstance(obj, dict) or set(obj) != {"view", "votes"}:
        raise InvalidRecord("a timeout certificate must be {'view': n, 'votes': {...}}")
    view, votes = obj["view"], obj["votes"]
    if not isinstance(view, int) or isinstance(view, bool) or not isinstance(votes, dict):
        raise InvalidRecord("a timeout certificate's view must be an int and votes an object")
    if len(votes) > 64:
        raise InvalidRecord("a timeout certificate holds at most 64 votes")
    parsed = [parse_vote(run, version, view, voter, v) for voter, v in sorted(votes.items())]
    return TimeoutCert(view, tuple(parsed))


def timeout_lock(tc: TimeoutCert, members: Sequence[str], quorum: int) -> tuple[bool, str | None]:
    """Whether ``tc``'s votes from ``members`` prove that its view can certify nothing new, and
    the content it may still have certified (its *lock*), if any.

    With N members silent, a content voters signed n times could have reached the quorum iff
    N + n + MARGIN ≥ quorum. The votes are a timeout certificate iff the silent members alone
    could not certify (N + MARGIN < quorum) and at most one content could have: that content is
    the lock (None: the view certified nothing, the next view is free). Returns (False, None)
    when the votes prove nothing yet.
    """
    if not members or quorum < 1:
        return False, None
    member_set = set(members)
    votes = [v for v in tc.votes if v.voter in member_set]
    silent = len(member_set) - len(votes)
    if silent + MARGIN >= quorum:
        return False, None
    signed = Counter(v.signed for v in votes if v.signed is not None)
    possible = sorted(c for c, n in signed.items() if silent + n + MARGIN >= quorum)
    if len(possible) > 1:
        return False, None
    return True, (possible[0] if possible else None)


def timeout_cert_of(view: int, votes: Mapping[str, ViewVote]) -> TimeoutCert:
    """The TC made of ``votes`` (voter → vote) for ``view``."""
    return TimeoutCert(view, tuple(votes[k] for k in sorted(votes) if votes[k].view == view))
