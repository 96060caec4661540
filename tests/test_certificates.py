"""Quorum certificates: q valid committee signatures over one body; receipts inside."""

from __future__ import annotations

import hashlib

import pytest

from p2pdiloco.protocol.certificates import (
    Accepted,
    CertificateBody,
    assemble,
    parse_certificate,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.sync.committee import beacon

RUN = "ab" * 32
SYNCERS = [Identity.from_seed(bytes([i]) * 32) for i in range(4)]
LEARNERS = [Identity.from_seed(bytes([100 + i]) * 32) for i in range(3)]


def body(**kw) -> CertificateBody:
    accepted = sorted(
        (Accepted(peer_id=who.peer_id, digest=hashlib.sha256(bytes([i])).hexdigest(), steps=20, tokens=20 * 1024)
         for i, who in enumerate(LEARNERS)),
        key=lambda a: a.digest,
    )  # fmt: skip
    base = dict(run=RUN, version=8, base_version=7, state_hash="cd" * 32,
                committee=[s.peer_id for s in SYNCERS], quorum=3, accepted=accepted)  # fmt: skip
    base.update(kw)
    return CertificateBody(**base)


def test_quorum_of_signatures_certifies_and_carries_receipts() -> None:
    b = body()
    raw = assemble(b, {s.peer_id: sign_body(s, b) for s in SYNCERS[:3]})
    cert = parse_certificate(raw, run_id=RUN)
    assert cert.body.version == 8 and len(cert.signers) == 3
    receipts = cert.receipts(LEARNERS[1].peer_id)
    assert len(receipts) == 1 and receipts[0].tokens == 20 * 1024
    assert beacon(RUN, cert.raw) != beacon(RUN, None)


def test_below_quorum_forged_outsider_and_tampered_are_refused() -> None:
    b = body()
    sigs = {s.peer_id: sign_body(s, b) for s in SYNCERS[:2]}
    with pytest.raises(InvalidRecord, match="2 valid committee signatures, needs 3"):
        parse_certificate(assemble(b, sigs))
    outsider = Identity.generate()
    forged = {**sigs, SYNCERS[2].peer_id: "00" * 64, outsider.peer_id: sign_body(outsider, b)}
    with pytest.raises(InvalidRecord, match="needs 3"):
        parse_certificate(assemble(b, forged))
    # A valid certificate whose body is altered (an extra receipt) no longer verifies.
    good = {s.peer_id: sign_body(s, b) for s in SYNCERS}
    evil = body(state_hash="ee" * 32)
    with pytest.raises(InvalidRecord, match="needs 3"):
        parse_certificate(assemble(evil, good))
    with pytest.raises(InvalidRecord, match="for run"):
        parse_certificate(assemble(b, good), run_id="ff" * 32)


def test_malformed_certificates_are_refused_before_work() -> None:
    with pytest.raises(InvalidRecord, match="too large"):
        parse_certificate(b"{" * (2 * 1024 * 1024))
    for raw in (b"not json", b"[]", b'{"body": {}}', b'{"body": {}, "sigs": {}}'):
        with pytest.raises(InvalidRecord):
            parse_certificate(raw)
    with pytest.raises(ValueError):
        body(quorum=5)
    with pytest.raises(ValueError):
        body(base_version=8)
