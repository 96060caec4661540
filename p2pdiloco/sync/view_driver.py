"""The syncer service's view change on the wire: the ``vote`` message, signed and sent.

``SyncService`` owns one ``ViewDriver``. When the node's ``SyncerNode`` says a vote is due
(``core/views.py: leave_view``: the view timed out, or its round is stuck; the round then
signs nothing more in that view), the driver signs it, sends it to the committees of the view
and of the next one, and casts it; it opens the ``vote`` requests fellow nodes send and hands
them to the node's ``ViewState`` (``hear_vote``). Either says when the node has moved to a new
view, so the service opens that view's round. The protocol is in ``protocol/view_change.py``.

Vote message (one frame, canonical JSON, at most ``MAX_VOTE_BYTES``):
``{"version": v + 1, "view": j, "voter": peer id, "vote": {"signed", "sig"},
"views": [the timeout certificate of view j − 1, or none in view 0], "body": the body the voter
signed or null,
"lock": a body of the content the earlier views locked, or null}``. The bodies are checked
against the signed content digests before they are believed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from p2pdiloco.core.views import ViewState, VoteIntent, catch_up, hear_vote
from p2pdiloco.protocol.certificates import CertificateBody, content_digest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.signing import InvalidRecord, canonical_json
from p2pdiloco.protocol.view_change import (
    TimeoutCert,
    ViewVote,
    parse_timeout_cert,
    parse_vote,
    sign_vote,
)
from p2pdiloco.sync.committee_msgs import MAX_VOTE_BYTES, BadMessage

log = logging.getLogger(__name__)


_KEYS = {"version", "view", "voter", "vote", "views", "body", "lock"}


def vote_message(
    vote: ViewVote,
    tcs: list[TimeoutCert],
    body: CertificateBody | None,
    lock: CertificateBody | None,
) -> bytes:
    return canonical_json(
        {
            "version": vote.version,
            "view": vote.view,
            "voter": vote.voter,
            "vote": vote.wire(),
            "views": [tc.wire() for tc in tcs],
            "body": body.model_dump(mode="json") if body is not None else None,
            "lock": lock.model_dump(mode="json") if lock is not None else None,
        }
    )


def _body(obj: object) -> CertificateBody | None:
    return None if obj is None else CertificateBody.model_validate(obj)


@dataclass(frozen=True)
class VoteMessage:
    vote: ViewVote
    tcs: list[TimeoutCert]
    body: CertificateBody | None  # what the voter signed (content digest = vote.signed)
    lock: CertificateBody | None  # a body of the content the earlier views locked


def open_vote(raw: bytes, run_id: str) -> VoteMessage:
    """A vote message, every signature in it checked; BadMessage (one line) if it is not one."""
    try:
        if len(raw) > MAX_VOTE_BYTES:
            raise InvalidRecord(f"vote message of {len(raw)} bytes exceeds {MAX_VOTE_BYTES}")
        msg = json.loads(raw.decode("utf-8"))
        if not isinstance(msg, dict) or set(msg) != _KEYS:
            raise InvalidRecord(f"a vote message needs {', '.join(sorted(_KEYS))}")
        version, view, views = msg["version"], msg["view"], msg["views"]
        if not isinstance(version, int) or not isinstance(view, int) or not isinstance(views, list):
            raise InvalidRecord("a vote message's version and view are ints, views a list")
        if len(views) > 1:
            raise InvalidRecord("a vote message carries at most one timeout certificate")
        vote = parse_vote(run_id, version, view, msg["voter"], msg["vote"])
        tcs = [parse_timeout_cert(run_id, version, tc) for tc in views]
        body, lock = _body(msg["body"]), _body(msg["lock"])
        if (body is None) != (vote.signed is None) or (
            body is not None and content_digest(body) != vote.signed
        ):
            raise InvalidRecord("a vote's body must be the content it says it signed")
    except (InvalidRecord, UnicodeDecodeError, ValueError, RecursionError) as e:
        code = Reason.INVALID_SIGNATURE if "verify" in str(e) else Reason.MALFORMED
        raise BadMessage(code, f"invalid vote: {str(e)[:200]}") from None
    return VoteMessage(vote, tcs, body, lock)


class ViewDriver:
    """Signs and sends this node's votes and opens fellows' vote messages; what to vote, when
    and to whom is ``core/views.py``'s (``leave_view``, ``hear_vote``) and the ``ViewState``
    is the syncer node's."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        views: Callable[[], ViewState | None],
        send: Callable[[str, str, bytes], Awaitable[None]],
        spawn: Callable[[Awaitable[None]], None],
    ) -> None:
        self.identity = identity
        self.run_id = run_id
        self._views = views  # the syncer node's (its one owner)
        self.send = send
        self.spawn = spawn
        self._caught_up: set[tuple[int, int, str]] = set()  # (version, view, fellow) sent

    @property
    def state(self) -> ViewState | None:
        """The node's view state (None before its first certified version)."""
        return self._views()

    def vote(self, intent: VoteIntent, body: CertificateBody | None, now: float) -> bool:
        """Sign the vote ``intent`` decided (``body``: the content this node signed in the
        view, if any), send it, and cast it; True if that vote moved the node to a new view."""
        st = self.state
        assert st is not None
        signed = content_digest(body) if body is not None else None
        vote = sign_vote(
            self.identity, self.run_id, intent.version, intent.view, signed, intent.lock
        )
        log.warning(
            "no certificate for version %d in view %d after %.0f s: voting to hand it to view %d "
            "(%s)",
            st.version,
            st.view,
            now - st.opened_at,
            st.view + 1,
            "signed nothing" if signed is None else f"signed {signed[:12]}",
        )
        lock = st.bodies.get(st.lock) if st.lock is not None else None
        raw = vote_message(vote, list(st.tcs), body, lock)
        for peer in intent.recipients:
            self.spawn(self.send(peer, "vote", raw))
        return st.cast(vote, now, body)

    def catch_up(self, peer: str) -> bool:
        """``peer`` refused this node's proposal or signature for want of an open round: send
        it the TC that ended the view before this node's (``core.views.catch_up``), once per
        view; True if sent."""
        st = self.state
        what = catch_up(st) if st is not None else None
        if st is None or what is None:
            return False
        key = (st.version, st.view, peer)
        if key in self._caught_up:
            return False
        self._caught_up = {k for k in self._caught_up if k[:2] == key[:2]} | {key}
        log.info(
            "%s has no open round for view %d of version %d: sending it the timeout "
            "certificate of view %d",
            peer[-8:],
            st.view,
            st.version,
            what.tc.view,
        )
        raw = vote_message(what.vote, [what.tc], what.body, what.lock)
        self.spawn(self.send(peer, "vote", raw))
        return True

    def on_vote(self, raw: bytes, now: float) -> bool:
        """A fellow node's vote message (BadMessage if invalid); True if this node moved on."""
        msg = open_vote(raw, self.run_id)
        st = self.state
        return st is not None and hear_vote(st, msg.vote, msg.tcs, msg.body, msg.lock, now)
