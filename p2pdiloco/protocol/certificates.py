"""Quorum certificates for global versions, which double as contribution receipts.

A syncer signs the certificate *body*: run, new version, its base, the state hash, the committee
and quorum, and the sorted list of accepted submissions (peer, digest, steps, tokens). q matching
signatures from distinct committee members make the certificate valid. Because the accepted list
is inside what the committee signs, each certificate is also the signed receipt of every delta it
merged: the contribution ledger is the sum over verified certificates, not over anyone's claims.

Wire form (canonical JSON): ``{"body": {...}, "sigs": {"<peer id>": "<128 hex>", ...}}``; each
signature is over ``signing_message("certificate", run, canonical_json(body))``. The certificate
bytes are also the beacon input of the next committee election.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from p2pdiloco.protocol.identity import Identity, public_key_from_peer_id, verify
from p2pdiloco.protocol.signing import (
    InvalidRecord,
    PeerIdStr,
    canonical_json,
    schema_error_reason,
    signing_message,
)

CERTIFICATE_KIND = "certificate"
MAX_CERTIFICATE_BYTES = 1024 * 1024
Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Accepted(_Strict):
    """One merged submission: the receipt of a learner's contribution."""

    peer_id: PeerIdStr
    digest: Hex64
    steps: int = Field(ge=1, le=10**9)
    tokens: int = Field(ge=1, le=10**15)


class CertificateBody(_Strict):
    run: Hex64
    version: int = Field(ge=1)
    base_version: int = Field(ge=0)
    state_hash: Hex64
    committee: list[PeerIdStr] = Field(min_length=1, max_length=64)
    quorum: int = Field(ge=1, le=64)
    accepted: list[Accepted] = Field(max_length=4096)

    @model_validator(mode="after")
    def _consistent(self) -> CertificateBody:
        if self.base_version >= self.version:
            raise ValueError("base_version must be below version")
        if self.quorum > len(self.committee) or len(set(self.committee)) != len(self.committee):
            raise ValueError("quorum exceeds the committee, or the committee repeats a member")
        digests = [a.digest for a in self.accepted]
        if digests != sorted(set(digests)):
            raise ValueError("accepted submissions must be sorted by digest, without repeats")
        return self


def sign_body(identity: Identity, body: CertificateBody) -> str:
    """A syncer's signature (hex) over the certificate body."""
    msg = signing_message(CERTIFICATE_KIND, body.run, canonical_json(body.model_dump(mode="json")))
    return identity.sign(msg).hex()


@dataclass(frozen=True)
class Certificate:
    body: CertificateBody
    signers: tuple[str, ...]  # committee members whose signatures verified
    raw: bytes

    def receipts(self, peer_id: str) -> list[Accepted]:
        return [a for a in self.body.accepted if a.peer_id == peer_id]


def assemble(body: CertificateBody, signatures: dict[str, str]) -> bytes:
    """Wire bytes of a certificate from a body and collected signatures (not verified here)."""
    return canonical_json(
        {"body": body.model_dump(mode="json"), "sigs": dict(sorted(signatures.items()))}
    )


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
        or set(obj) != {"body", "sigs"}
        or not isinstance(obj["sigs"], dict)
    ):
        raise InvalidRecord("certificate must be an object with 'body' and 'sigs'")
    try:
        body = CertificateBody.model_validate(obj["body"])
    except ValidationError as e:
        raise InvalidRecord(schema_error_reason("certificate", e)) from None
    if run_id is not None and body.run != run_id:
        raise InvalidRecord(f"certificate is for run {body.run[:12]}, expected {run_id[:12]}")
    msg = signing_message(CERTIFICATE_KIND, body.run, canonical_json(body.model_dump(mode="json")))
    members = set(body.committee)
    signers = []
    for peer, sig in sorted(obj["sigs"].items()):
        if peer not in members or not isinstance(sig, str) or len(sig) != 128:
            continue
        try:
            ok = verify(public_key_from_peer_id(peer), msg, bytes.fromhex(sig))
        except Exception:  # malformed peer id or hex from an untrusted certificate
            ok = False
        if ok:
            signers.append(peer)
    if len(signers) < body.quorum:
        raise InvalidRecord(
            f"certificate for version {body.version} has {len(signers)} valid committee "
            f"signatures, needs {body.quorum}"
        )
    return Certificate(body=body, signers=tuple(signers), raw=raw)
