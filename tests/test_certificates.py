"""Quorum certificates: q valid committee signatures over one body; receipts inside."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from p2pdiloco.core.committee import beacon
from p2pdiloco.protocol.certificates import (
    MAX_CERTIFICATE_BYTES,
    Accepted,
    CertificateBody,
    Rejected,
    RosterEntry,
    assemble,
    body_digest,
    parse_certificate,
    roster_digest,
    sign_body,
    verify_body_signature,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.signing import InvalidRecord, canonical_json

RUN = "ab" * 32
SYNCERS = [Identity.from_seed(bytes([i]) * 32) for i in range(4)]
LEARNERS = [Identity.from_seed(bytes([100 + i]) * 32) for i in range(3)]


def body(**kw: Any) -> CertificateBody:
    accepted = sorted(
        (
            Accepted(
                peer_id=who.peer_id,
                digest=hashlib.sha256(bytes([i])).hexdigest(),
                steps=20,
                tokens=20 * 1024,
            )
            for i, who in enumerate(LEARNERS)
        ),
        key=lambda a: a.digest,
    )
    base: dict[str, Any] = dict(
        run=RUN,
        version=8,
        base_version=7,
        state_hash="cd" * 32,
        committee=[s.peer_id for s in SYNCERS],
        quorum=3,
        accepted=accepted,
        roster_hash=roster_digest([]),
    )
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
        parse_certificate(b"{" * (MAX_CERTIFICATE_BYTES + 1))
    for raw in (b"not json", b"[]", b'{"body": {}}', b'{"body": {}, "sigs": {}}'):
        with pytest.raises(InvalidRecord):
            parse_certificate(raw)
    with pytest.raises(ValueError):
        body(quorum=5)
    with pytest.raises(ValueError):
        body(base_version=8)


def digest_of(i: int) -> str:
    return hashlib.sha256(b"rejected" + bytes([i])).hexdigest()


def rejected(*idx: int, who: Identity = LEARNERS[0]) -> list[Rejected]:
    return sorted(
        (
            Rejected(peer_id=who.peer_id, digest=digest_of(i), reason="norm 40.1 > 3 x median")
            for i in idx
        ),
        key=lambda r: r.digest,
    )


def entry(who: Identity, **kw: int) -> RosterEntry:
    base: dict[str, Any] = dict(joined_version=0, accepted=1, tokens=100, last_version=8)
    base.update(kw)
    return RosterEntry(peer_id=who.peer_id, **base)


def roster(*who: Identity) -> list[RosterEntry]:
    return sorted((entry(w) for w in who), key=lambda e: e.peer_id)


def test_rejected_and_roster_hash_are_signed_and_round_trip() -> None:
    b = body(rejected=rejected(1, 2), roster_hash=roster_digest(roster(*LEARNERS)))
    cert = parse_certificate(assemble(b, {s.peer_id: sign_body(s, b) for s in SYNCERS[:3]}))
    assert cert.body == b and len(cert.body.rejected) == 2
    assert cert.body.roster_hash == roster_digest(roster(*LEARNERS))
    assert cert.roster is None  # not on the wire: derived from the chain (ADR 0044)
    assert cert.body.rejected[0].reason == "norm 40.1 > 3 x median"
    # both are inside what the committee signed: changing either breaks every signature
    sigs = {s.peer_id: sign_body(s, b) for s in SYNCERS}
    for evil in (body(rejected=rejected(1), roster_hash=b.roster_hash), body(rejected=b.rejected)):
        with pytest.raises(InvalidRecord, match="0 valid committee signatures"):
            parse_certificate(assemble(evil, sigs))
    # a body without rejections parses with an empty list
    assert body().rejected == []


def test_roster_digest_is_over_the_canonical_list_in_order() -> None:
    entries = roster(*LEARNERS)
    dumped = canonical_json([e.model_dump(mode="json") for e in entries])
    assert roster_digest(entries) == hashlib.sha256(dumped).hexdigest()
    assert roster_digest(entries[::-1]) != roster_digest(entries)
    assert roster_digest(entries[:2]) != roster_digest(entries)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rejected": list(reversed(rejected(1, 2)))}, "rejected submissions must be sorted"),
        ({"rejected": rejected(1) * 2}, "rejected submissions must be sorted"),
        ({"roster_hash": "AB" * 32}, "roster_hash"),
        ({"roster_hash": "ab" * 31}, "roster_hash"),
        ({"roster": roster(LEARNERS[0])}, "roster"),  # the list itself is never on the wire
    ],
)
def test_rejected_ordering_and_roster_hash_are_enforced(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        body(**kw)


def test_a_submission_cannot_be_both_accepted_and_rejected() -> None:
    taken = body().accepted[0]
    clash = Rejected(peer_id=taken.peer_id, digest=taken.digest, reason="late")
    with pytest.raises(ValueError, match="both accepted and rejected"):
        body(rejected=[clash])


@pytest.mark.parametrize(
    "over",
    [
        {"reason": ""},
        {"reason": "x" * 201},
        {"reason": "evil\x1b[2J"},
        {"reason": "line\nbreak"},
        {"digest": "AB" * 32},
        {"peer_id": "12D3KooWnotapeerid"},
        {"extra": 1},
    ],
)
def test_rejected_entry_schema(over: dict) -> None:
    good = {"peer_id": LEARNERS[0].peer_id, "digest": digest_of(0), "reason": "stale base"}
    Rejected.model_validate(good)
    with pytest.raises(ValueError):
        Rejected.model_validate({**good, **over})


@pytest.mark.parametrize(
    "over",
    [{"accepted": -1}, {"tokens": 2**63}, {"joined_version": True}, {"last_version": 1.0}],
)
def test_roster_entry_schema(over: dict) -> None:
    good = {
        "peer_id": LEARNERS[0].peer_id,
        "joined_version": 0,
        "accepted": 0,
        "tokens": 0,
        "last_version": 0,
    }
    RosterEntry.model_validate(good)
    with pytest.raises(ValueError):
        RosterEntry.model_validate({**good, **over})


def test_body_digest_ignores_signatures_and_tracks_the_body() -> None:
    b = body(roster_hash=roster_digest(roster(*LEARNERS)))
    some = parse_certificate(assemble(b, {s.peer_id: sign_body(s, b) for s in SYNCERS[:3]}))
    other = parse_certificate(assemble(b, {s.peer_id: sign_body(s, b) for s in SYNCERS[1:]}))
    assert some.raw != other.raw
    assert body_digest(some.body) == body_digest(other.body) == body_digest(b)
    assert body_digest(b) == hashlib.sha256(canonical_json(b.model_dump(mode="json"))).hexdigest()
    assert body_digest(body(state_hash="ee" * 32)) != body_digest(body())
    assert body_digest(body(rejected=rejected(3))) != body_digest(body())


def test_verify_body_signature_never_raises() -> None:
    b = body()
    sig = sign_body(SYNCERS[0], b)
    assert verify_body_signature(SYNCERS[0].peer_id, b, sig)
    assert not verify_body_signature(SYNCERS[1].peer_id, b, sig)  # someone else's key
    assert not verify_body_signature(SYNCERS[0].peer_id, body(state_hash="ee" * 32), sig)
    other_run = body(run="cd" * 32)
    assert not verify_body_signature(SYNCERS[0].peer_id, other_run, sig)
    junk: list[tuple[object, object]] = [
        (SYNCERS[0].peer_id, "zz" * 64),
        (SYNCERS[0].peer_id, sig[:-2]),
        (SYNCERS[0].peer_id, sig.upper()),
        (SYNCERS[0].peer_id, None),
        (SYNCERS[0].peer_id, bytes.fromhex(sig)),
        ("12D3KooWnotapeerid", sig),
        ("", sig),
        (None, sig),
        (12345, sig),
    ]
    for peer, s in junk:
        assert verify_body_signature(peer, b, s) is False  # type: ignore[arg-type]
