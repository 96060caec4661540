"""The committee's own messages and the certificate body a merge produces; pure functions.

A proposal is an envelope of kind ``proposal`` {version, attempt, digests}; a signature message
is canonical JSON {signer, body, sig} over a ``CertificateBody``. Both are parsed here with
size and shape checks before anything is kept, and refused with a ``Reason`` code.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from p2pdiloco.core.roster import CommitteeInfo, roster_after
from p2pdiloco.core.weights import plausible_claim
from p2pdiloco.protocol.certificates import (
    MAX_CERTIFICATE_BYTES,
    MAX_RECEIPTS,
    Accepted,
    Certificate,
    CertificateBody,
    Rejected,
    roster_digest,
    verify_body_signature,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord, canonical_json, open_envelope, seal
from p2pdiloco.protocol.submissions import SubmissionHeader
from p2pdiloco.protocol.view_change import MAX_VIEW
from p2pdiloco.sync.certified import CertifiedState

PROPOSAL_KIND = "proposal"
MAX_PROPOSAL_DIGESTS = MAX_RECEIPTS  # an input set is merged whole: one receipt per input
# A proposal of MAX_PROPOSAL_DIGESTS digests (64 hex + quotes and comma each) plus the envelope.
MAX_PROPOSAL_BYTES = 16 * 1024 + MAX_PROPOSAL_DIGESTS * 70


class BadMessage(Exception):
    """A committee message that fails its checks; ``code`` says which, ``signer`` who sent it."""

    def __init__(self, code: Reason, text: str, signer: str | None = None) -> None:
        super().__init__(text)
        self.code = code
        self.signer = signer


@dataclass(frozen=True)
class Proposal:
    signer: str
    version: int
    attempt: int
    digests: tuple[str, ...]
    view: int = 0


def seal_proposal(
    identity: Identity,
    run_id: str,
    version: int,
    attempt: int,
    digests: tuple[str, ...],
    view: int = 0,
) -> bytes:
    body = {"version": version, "view": view, "attempt": attempt, "digests": list(digests)}
    return seal(identity, PROPOSAL_KIND, run_id, body)


def open_proposal(raw: bytes, run_id: str) -> Proposal:
    try:
        env = open_envelope(raw, kind=PROPOSAL_KIND, run_id=run_id, max_bytes=MAX_PROPOSAL_BYTES)
    except InvalidRecord as e:
        raise BadMessage(Reason.INVALID_SIGNATURE, f"invalid proposal: {e}", e.signer) from None
    b = env.body
    version, attempt, digests = b.get("version"), b.get("attempt"), b.get("digests")
    view = b.get("view")
    if not (
        isinstance(version, int)
        and isinstance(view, int)
        and 0 <= view <= MAX_VIEW
        and isinstance(attempt, int)
        and 0 <= attempt < 2**31
        and isinstance(digests, list)
        and len(digests) <= MAX_PROPOSAL_DIGESTS
        and all(isinstance(d, str) and len(d) == 64 for d in digests)
    ):
        raise BadMessage(Reason.MALFORMED, "proposal body malformed", env.signer)
    return Proposal(env.signer, version, attempt, tuple(digests), view)


def signature_message(me: str, body: CertificateBody, sig: str) -> bytes:
    return canonical_json({"signer": me, "body": body.model_dump(mode="json"), "sig": sig})


def open_signature(raw: bytes) -> tuple[str, CertificateBody, str]:
    """(signer, body, sig) of a verified signature message; BadMessage otherwise."""
    try:
        msg = json.loads(raw.decode())
        if not isinstance(msg, dict) or set(msg) != {"signer", "body", "sig"}:
            raise ValueError("signature message needs signer, body and sig")
        body = CertificateBody.model_validate(msg["body"])
        signer, sig = msg["signer"], msg["sig"]
    except Exception as e:
        raise BadMessage(Reason.MALFORMED, f"invalid signature message: {str(e)[:200]}") from None
    if not isinstance(signer, str) or not verify_body_signature(signer, body, sig):
        raise BadMessage(Reason.INVALID_SIGNATURE, "certificate signature does not verify")
    return signer, body, sig


def certificate_body(
    run_id: str,
    manifest: RunManifest,
    base: CertifiedState,
    committee: CommitteeInfo,
    new_state_hash: str,
    headers: dict[str, SubmissionHeader],
    accepted_digests: list[str],
    rejected: dict[str, str],
    view: int = 0,
    update_hash: str | None = None,
    *,
    eval_loss: float | None = None,
    params_hash: str | None = None,
    uncredited: Collection[str] = (),
) -> CertificateBody:
    """The body every honest syncer builds from the same merge: sorted, bounded, with roster;
    each receipt credits the clipped claim (``plausible_claim``), as the merge weighed it, but
    the ``uncredited`` ones (merged, no work shown: ``MergeResult.uncredited``) credit 0 tokens;
    with the eval loss this syncer measured on the merged state, in a run that certifies one."""
    senders = {d: (h.peer_id, h.steps, h.tokens) for d, h in headers.items()}
    return body_of(
        run_id,
        manifest,
        base.version,
        base.cert,
        committee,
        new_state_hash,
        senders,
        accepted_digests,
        rejected,
        view,
        update_hash,
        eval_loss=eval_loss,
        params_hash=params_hash,
        uncredited=uncredited,
    )


def body_of(
    run_id: str,
    manifest: RunManifest,
    base_version: int,
    base_cert: Certificate | None,
    committee: CommitteeInfo,
    new_state_hash: str,
    senders: Mapping[str, tuple[str, int, int]],
    accepted_digests: list[str],
    rejected: Mapping[str, str],
    view: int = 0,
    update_hash: str | None = None,
    *,
    eval_loss: float | None = None,
    params_hash: str | None = None,
    uncredited: Collection[str] = (),
) -> CertificateBody:
    """:func:`certificate_body` on its inputs: per digest (peer id, steps, tokens) as signed.
    The simulator (``p2pdiloco.sim``) builds its certificates with it."""
    claims = {
        d: plausible_claim(senders[d][1], senders[d][2], manifest.inner_steps)
        for d in accepted_digests
    }  # what the round weighed: the signed claim, clipped to one delta's steps
    accepted = [
        Accepted(
            peer_id=senders[d][0],
            digest=d,
            steps=claims[d][0],
            tokens=0 if d in uncredited else claims[d][1],
        )
        for d in sorted(accepted_digests)
    ]
    refused = [
        Rejected(peer_id=senders[d][0], digest=d, reason=r[:200])
        for d, r in sorted(rejected.items())
    ]
    return CertificateBody(
        run=run_id,
        version=base_version + 1,
        base_version=base_version,
        view=view,
        state_hash=new_state_hash,
        update_hash=update_hash,
        params_hash=params_hash,
        committee=list(committee.members),
        quorum=committee.quorum,
        accepted=accepted,
        rejected=refused,
        roster_hash=roster_digest(roster_after(manifest, base_cert, accepted)),
        eval_loss=eval_loss,
    )


MAX_SIGNATURE_BYTES = MAX_CERTIFICATE_BYTES  # a signature message carries the body it signs
MAX_VOTE_BYTES = 256 * 1024  # a view vote with one timeout certificate of 64 votes, two bodies


def request_limits(max_payload: int) -> dict[str, tuple[int, ...]]:
    """Per-op request frame limits of the sync protocol (docs/protocol.md, Sync transport)."""
    return {
        "submit": (16 * 1024, max_payload),
        "propose": (MAX_PROPOSAL_BYTES,),
        "sign": (MAX_SIGNATURE_BYTES,),
        "vote": (MAX_VOTE_BYTES,),
        "fetch": (),
        "receipt": (),
        "cert": (),
        "index": (),
        "chunk": (),
        "update": (),
    }
