"""The certificate bodies, signatures and merged states of one round (one view of a version).

Held by ``SyncService`` and cleared whenever a round ends or the node moves to another view;
bounded by the committee: at most two distinct bodies per member are kept.
"""

from __future__ import annotations

from p2pdiloco.net.sync_rpc import RpcRefused
from p2pdiloco.protocol.certificates import (
    Certificate,
    CertificateBody,
    assemble,
    body_digest,
    content_digest,
    parse_certificate,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.view_change import TimeoutCert
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.sync.committee_msgs import signature_message


def refusal_of(
    body: CertificateBody, run_id: str, base: int, view: int, committee: tuple[str, ...]
) -> tuple[Reason, str] | None:
    """Why a fellow's signed body for the round on ``base`` in ``view`` is not one this
    member's round can count (None: it is): another run or base, another view (it may be one
    this member has not reached: NO_OPEN_ROUND, retryable), or another committee."""
    if body.run != run_id or body.base_version != base:
        return Reason.WRONG_RUN, "signature for another run or base version"
    if body.view != view:
        return Reason.NO_OPEN_ROUND, f"signature for view {body.view}"
    if tuple(body.committee) != committee:
        return Reason.WRONG_COMMITTEE, "signed a body naming another committee"
    return None


class RoundSignatures:
    def __init__(self) -> None:
        self.bodies: dict[str, CertificateBody] = {}  # by body digest (the round's "state hash")
        self.sigs: dict[str, dict[str, str]] = {}  # body digest → signer → signature
        self.results: dict[str, CertifiedState] = {}  # body digest → the state this node merged

    def clear(self) -> None:
        self.bodies.clear()
        self.sigs.clear()
        self.results.clear()

    def own(self, identity: Identity, body: CertificateBody, state: CertifiedState) -> str:
        """This node's merge: keep its body and state, sign the body; returns the digest."""
        digest = body_digest(body)
        self.bodies[digest] = body
        self.results[digest] = state
        self.sigs.setdefault(digest, {})[identity.peer_id] = sign_body(identity, body)
        return digest

    def second(self, identity: Identity, digest: str) -> None:
        """Sign a fellow's body (the leader's, with its eval loss: ADR 0059) that holds the
        content this node merged; the state merged here is that body's state too."""
        body = self.bodies[digest]
        self.sigs.setdefault(digest, {})[identity.peer_id] = sign_body(identity, body)
        content = content_digest(body)
        for d, state in list(self.results.items()):
            if content_digest(self.bodies[d]) == content:
                self.results[digest] = state
                break

    def add(self, signer: str, body: CertificateBody, sig: str, committee_size: int) -> str:
        """A fellow member's verified signature; BUSY once 2 × k distinct bodies are held."""
        digest = body_digest(body)
        if digest not in self.bodies and len(self.bodies) >= 2 * committee_size:
            raise RpcRefused(Reason.BUSY, "too many distinct bodies this round")
        self.bodies.setdefault(digest, body)
        self.sigs.setdefault(digest, {})[signer] = sig
        return digest

    def message(self, me: str, digest: str) -> bytes:
        """The signature message this node sends for the body ``digest``."""
        return signature_message(me, self.bodies[digest], self.sigs[digest][me])

    def certificate(
        self, digest: str, signers: tuple[str, ...], tcs: tuple[TimeoutCert, ...], run_id: str
    ) -> tuple[bytes, Certificate, CertifiedState | None]:
        """The certificate of ``digest`` from ``signers``' signatures (and, for a later view, the
        timeout certificate of the view before), verified; with the state if merged here."""
        body = self.bodies[digest]
        proof = tuple(tc for tc in tcs if tc.view == body.view - 1)
        raw = assemble(body, {s: self.sigs[digest][s] for s in signers}, proof)
        cert = parse_certificate(raw, run_id=run_id)
        state = self.results.get(digest)
        if state is not None:
            state.cert = cert
        return raw, cert, state
