"""Quorum certificates for global versions, which double as contribution receipts.

A syncer signs the certificate *body*: run, new version, its base, the state hash, the hash of
the update that made the state from its base (ADR 0029), the committee and quorum, the sorted
lists of accepted and rejected submissions, and the hash of the roster of peers who may sit on
later committees (the roster itself is derived from the chain, ADR 0044). q matching
signatures from distinct committee members make the certificate valid. Because the accepted
list is inside what the committee signs, each certificate is also the signed receipt of every
delta it merged: the contribution ledger is the sum over verified certificates, not over
anyone's claims.

Wire form (canonical JSON): ``{"body": {...}, "sigs": {"<peer id>": "<128 hex>", ...}}``; each
signature is over ``signing_message("certificate", run, canonical_json(body))``. Different
syncers may assemble different signature sets for the same body, so anything that must be the
same on every node (the next committee's beacon, de-duplication) uses the body
(:func:`body_digest`), never the certificate bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from p2pdiloco.protocol.identity import Identity, verify_hex
from p2pdiloco.protocol.records import NonNegInt
from p2pdiloco.protocol.signing import (
    InvalidRecord,
    PeerIdStr,
    canonical_json,
    schema_error_reason,
    signing_message,
)
from p2pdiloco.protocol.view_change import MAX_VIEW, TimeoutCert, parse_timeout_cert

CERTIFICATE_KIND = "certificate"
# Receipts one certificate lists: the most inputs a round may merge (ADR 0047). A receipt is
# about 172 bytes of JSON (10,000 of them: 1.7 MB), a refusal up to 940 with a reason of 200
# four-byte characters; at every bound, with 64 signatures, a certificate is 7.0 MB
# (tests/test_large_certificates.py). Certificates travel over the sync protocol (``cert``), whose
# reply may be this large, and on gossip only when small (net.gossip_limits.MAX_MESSAGE_BYTES).
MAX_RECEIPTS = 16_384
MAX_REFUSALS = 4096
MAX_CERTIFICATE_BYTES = 8 * 1024 * 1024
Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
# Printable only: reasons end up in logs, terminals and dashboards.
Reason = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f-\x9f]*$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class Accepted(_Strict):
    """One merged submission: the receipt of a learner's contribution.

    With work scoring (ADR 0062, 0065) a trusted learner's delta that showed no advantage on its
    own data is still merged but credits nothing: ``tokens`` is 0, and such an entry is no
    receipt (not ``credited``): no roster progress, no trust, no leaderboard credit. Its
    learner knows it was merged and does not send its work again."""

    peer_id: PeerIdStr
    digest: Hex64
    steps: int = Field(ge=1, le=10**9)
    tokens: int = Field(ge=0, le=10**15)

    @property
    def credited(self) -> bool:
        return self.tokens > 0


class Rejected(_Strict):
    """One submission the committee screened out, and why (the learner's signed feedback)."""

    peer_id: PeerIdStr
    digest: Hex64
    reason: Reason


class RosterEntry(_Strict):
    """What the certified history says about one peer who may sit on a later committee."""

    peer_id: PeerIdStr
    joined_version: NonNegInt  # the version the peer first trained from
    accepted: NonNegInt  # accepted deltas (receipts) so far
    tokens: NonNegInt  # tokens of those deltas: the election weight
    last_version: NonNegInt  # the version that last accepted one of its deltas


class CertificateBody(_Strict):
    """What the committee signs for one new global version."""

    run: Hex64
    version: int = Field(ge=1, le=2**63 - 1)
    base_version: int = Field(ge=0)
    # Which committee of this version signs: 0 is the elected one, j > 0 the one that took
    # over after views 0 … j − 1 timed out (the certificate carries the timeout certificate of
    # view j − 1, which carries the lock of every earlier view: ADR 0055).
    view: int = Field(default=0, ge=0, le=MAX_VIEW)
    state_hash: Hex64
    # sha256 of the encoded update that made this state from the base (sync.update, ADR 0029);
    # None: no update certified (bodies made outside a merge), peers download the whole state.
    update_hash: Hex64 | None = None
    # Runs whose update is the parameters' change (``rules.update_form`` "params", ADR 0064):
    # the hash of the parameters alone (``sync.state`` index of them), which a follower checks;
    # ``state_hash`` covers the committee state too (momentum, residual). None otherwise, and
    # then absent from the wire, so older bodies keep their bytes and signatures.
    params_hash: Hex64 | None = None
    committee: list[PeerIdStr] = Field(min_length=1, max_length=64)
    quorum: int = Field(ge=1, le=64)
    accepted: list[Accepted] = Field(max_length=MAX_RECEIPTS)  # sorted by digest
    rejected: list[Rejected] = Field(default_factory=list, max_length=MAX_REFUSALS)  # by digest
    # sha256 of the candidates of the next election (:func:`roster_digest` of
    # core.roster.next_roster over the previous roster and this version's receipts). The roster
    # is derived, not carried: every node computes it from the chain (ADR 0044).
    roster_hash: Hex64
    # Mean loss of this state on the run's held-out batches (``RunManifest.held_out``, ADR
    # 0059), as the view's leader computed it; every other signer checked it against its own
    # within the manifest's tolerance. None: the run evaluates nothing (absent on the wire).
    eval_loss: float | None = Field(default=None, ge=0, le=1e4)

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A body without an eval loss or a parameters hash hashes and signs as before those
        # fields existed: every certificate already made still verifies, with the same body
        # digest and beacon.
        data: dict[str, Any] = handler(self)
        if self.eval_loss is None:
            data.pop("eval_loss", None)
        if self.params_hash is None:
            data.pop("params_hash", None)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> CertificateBody:
        if self.base_version >= self.version:
            raise ValueError("base_version must be below version")
        if self.quorum > len(self.committee) or len(set(self.committee)) != len(self.committee):
            raise ValueError("quorum exceeds the committee, or the committee repeats a member")
        digests = [a.digest for a in self.accepted]
        if digests != sorted(set(digests)):
            raise ValueError("accepted submissions must be sorted by digest, without repeats")
        rejected = [r.digest for r in self.rejected]
        if rejected != sorted(set(rejected)):
            raise ValueError("rejected submissions must be sorted by digest, without repeats")
        if not set(digests).isdisjoint(rejected):
            raise ValueError("a submission is both accepted and rejected")
        return self


def roster_digest(roster: Sequence[RosterEntry]) -> str:
    """Hex sha256 of a roster's canonical JSON list (entries in the order given: sorted by peer
    id, as ``next_roster`` returns them): what a certificate body carries as ``roster_hash``."""
    return hashlib.sha256(canonical_json([e.model_dump(mode="json") for e in roster])).hexdigest()


def _body_message(body: CertificateBody) -> bytes:
    return signing_message(CERTIFICATE_KIND, body.run, canonical_json(body.model_dump(mode="json")))


def body_digest(body: CertificateBody) -> str:
    """Hex sha256 of the canonical body: the same for every signature set over that body."""
    return hashlib.sha256(canonical_json(body.model_dump(mode="json"))).hexdigest()


# What a committee certifies, apart from who certifies it: a later view that re-certifies a
# locked content (protocol.view_change) produces another body with the same content. The eval
# loss is the view leader's measurement of that content (ADR 0059), not part of it.
_SIGNER_FIELDS = frozenset({"view", "committee", "quorum", "eval_loss"})


def content_json(body: CertificateBody) -> bytes:
    """Canonical JSON of the body without its view, committee, quorum and eval loss."""
    return canonical_json(body.model_dump(mode="json", exclude=set(_SIGNER_FIELDS)))


def content_digest(body: CertificateBody) -> str:
    """Hex sha256 of :func:`content_json`: equal for every view that certifies one content."""
    return hashlib.sha256(content_json(body)).hexdigest()


def sign_body(identity: Identity, body: CertificateBody) -> str:
    """A syncer's signature (hex) over the certificate body."""
    return identity.sign(_body_message(body)).hex()


def verify_body_signature(peer_id: str, body: CertificateBody, sig_hex: str) -> bool:
    """True if ``sig_hex`` (128 lowercase hex) is ``peer_id``'s valid signature over ``body``.

    Never raises: a malformed peer id or signature (any type) is simply false. Says nothing
    about committee membership; check that separately.
    """
    return verify_hex(peer_id, _body_message(body), sig_hex)


@dataclass(frozen=True)
class Certificate:
    body: CertificateBody
    signers: tuple[str, ...]  # committee members whose signatures verified
    raw: bytes
    # The timeout certificate of view body.view − 1 (none for view 0), votes verified; that it
    # proves its view's timeout is checked against the chain (core.roster.verify_successor).
    views: tuple[TimeoutCert, ...] = ()
    # The roster whose hash the body carries, once derived from the chain (core.roster
    # .verify_successor, or the committee that made the body); None for a certificate only
    # parsed. Not on the wire.
    roster: tuple[RosterEntry, ...] | None = field(default=None, compare=False, repr=False)

    def receipts(self, peer_id: str) -> list[Accepted]:
        """``peer_id``'s receipts: its merged deltas that were credited."""
        return [a for a in self.body.accepted if a.peer_id == peer_id and a.credited]


def assemble(
    body: CertificateBody, signatures: dict[str, str], views: tuple[TimeoutCert, ...] = ()
) -> bytes:
    """Wire bytes of a certificate from a body, collected signatures and, for a body of view
    j > 0, the timeout certificate of view j − 1 (not verified here)."""
    obj: dict[str, object] = {
        "body": body.model_dump(mode="json"),
        "sigs": dict(sorted(signatures.items())),
    }
    if views:
        obj["views"] = [tc.wire() for tc in views]
    return canonical_json(obj)


def parse_certificate(
    raw: bytes, *, run_id: str | None = None, max_bytes: int = MAX_CERTIFICATE_BYTES
) -> Certificate:
    """Verify a certificate: size before parse, schema, then ≥ quorum valid committee signatures.

    Signatures from non-members, malformed ones and ones that do not verify are ignored (not
    counted); raises InvalidRecord if fewer than the quorum remain, or on any schema problem.
    """
    if not isinstance(raw, bytes):
        raise InvalidRecord("certificate must be bytes")
    if len(raw) > max_bytes:
        raise InvalidRecord(f"certificate too large: {len(raw)} bytes > limit {max_bytes}")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidRecord("certificate is not UTF-8 JSON") from None
    if (
        not isinstance(obj, dict)
        or set(obj) - {"views"} != {"body", "sigs"}
        or not isinstance(obj["sigs"], dict)
    ):
        raise InvalidRecord("certificate must be an object with 'body', 'sigs' (and 'views')")
    try:
        body = CertificateBody.model_validate(obj["body"])
    except ValidationError as e:
        raise InvalidRecord(schema_error_reason("certificate", e)) from None
    if run_id is not None and body.run != run_id:
        raise InvalidRecord(f"certificate is for run {body.run[:12]}, expected {run_id[:12]}")
    msg = _body_message(body)  # once, not per signature: a body can be ~1 MB
    members = set(body.committee)
    signers = [
        peer
        for peer, sig in sorted(obj["sigs"].items())
        if peer in members and verify_hex(peer, msg, sig)
    ]
    if len(signers) < body.quorum:
        raise InvalidRecord(
            f"certificate for version {body.version} has {len(signers)} valid committee "
            f"signatures, needs {body.quorum}"
        )
    return Certificate(body, tuple(signers), raw, _views(body, obj.get("views", [])))


def _views(body: CertificateBody, wire: object) -> tuple[TimeoutCert, ...]:
    """The timeout certificate a view-j body needs: that of view j − 1 (none for view 0)."""
    want = 1 if body.view else 0
    if not isinstance(wire, list) or len(wire) != want:
        raise InvalidRecord(
            f"certificate of view {body.view} must carry {want} timeout certificate"
            + ("" if want == 1 else "s")
        )
    views = tuple(parse_timeout_cert(body.run, body.version, tc) for tc in wire)
    if views and views[0].view != body.view - 1:
        raise InvalidRecord(
            f"a certificate of view {body.view} must carry the timeout certificate of view "
            f"{body.view - 1}"
        )
    return views
