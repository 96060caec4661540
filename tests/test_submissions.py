"""Submission headers: signed, run-bound, schema-checked, bound to their signer and payload."""

from __future__ import annotations

import json
from typing import Any

import pytest

from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.signing import InvalidRecord, canonical_json, seal, signing_message
from p2pdiloco.protocol.submissions import (
    DATA_LAG,
    MAX_SUBMISSION_HEADER_BYTES,
    SUBMISSION_KIND,
    FragmentRef,
    ParsedSubmission,
    SubmissionHeader,
    open_submission,
    payload_digest,
    seal_submission,
)

RUN = "ab" * 32
NOW = 1_800_000_000.0
ALICE = Identity.from_seed(b"\x01" * 32)
BOB = Identity.from_seed(b"\x02" * 32)
PAYLOADS = [b"fragment zero", b"", b"\x00\xff" * 1000]


def header_body(who: Identity = ALICE, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "peer_id": who.peer_id,
        "base_version": 7,
        "steps": 500,
        "tokens": 500 * 8 * 128,
        "loss": 3.25,
        "codec": "int4",
        "fragments": [
            {"index": i, "digest": payload_digest(p), "nbytes": len(p)}
            for i, p in zip((0, 2, 5), PAYLOADS, strict=True)
        ],
    }
    body.update(over)
    return body


def header(who: Identity = ALICE, **over: Any) -> SubmissionHeader:
    return SubmissionHeader.model_validate(header_body(who, **over))


def raw_sealed(body: dict[str, Any], who: Identity = ALICE, run: str = RUN) -> bytes:
    """Sign any body (even one the schema refuses), as a malicious learner could."""
    return seal(who, SUBMISSION_KIND, run, body, ts=NOW)


def test_round_trip_and_payload_binding() -> None:
    raw = seal_submission(ALICE, RUN, header(), ts=NOW)
    sub = open_submission(raw, run_id=RUN, now=NOW)
    assert isinstance(sub, ParsedSubmission)
    assert sub.header == header() and sub.envelope.signer == ALICE.peer_id
    assert sub.header.fragments[1] == FragmentRef(index=2, digest=payload_digest(b""), nbytes=0)
    assert sub.digest == sub.envelope.digest and len(sub.digest) == 64
    assert sub.envelope.kind == SUBMISSION_KIND and sub.envelope.raw == raw
    # another signing moment is another submission id
    assert (
        open_submission(
            seal_submission(ALICE, RUN, header(), ts=NOW + 1), run_id=RUN, now=NOW
        ).digest
        != sub.digest
    )
    for index, payload in zip((0, 2, 5), PAYLOADS, strict=True):
        assert sub.check_fragment(index, payload).index == index
    assert sub.header.fragment(1) is None
    with pytest.raises(InvalidRecord, match="no fragment 1"):
        sub.check_fragment(1, b"x")
    with pytest.raises(InvalidRecord, match="bytes, header says") as info:
        sub.check_fragment(0, PAYLOADS[0] + b"!")
    assert info.value.signer == ALICE.peer_id and not info.value.signer_verified
    with pytest.raises(InvalidRecord, match="does not match its signed digest"):
        sub.check_fragment(0, b"F" + PAYLOADS[0][1:])
    assert payload_digest(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_forged_signature_and_tampered_body() -> None:
    obj = json.loads(seal_submission(ALICE, RUN, header(), ts=NOW))
    forged = {**obj, "sig": "00" * 64}
    with pytest.raises(InvalidRecord, match="bad signature") as info:
        open_submission(canonical_json(forged), run_id=RUN, now=NOW)
    assert info.value.signer == ALICE.peer_id and not info.value.signer_verified
    inflated = {**obj, "body": {**obj["body"], "tokens": 10**12}}
    with pytest.raises(InvalidRecord, match="bad signature") as info:
        open_submission(canonical_json(inflated), run_id=RUN, now=NOW)
    assert info.value.signer == ALICE.peer_id and not info.value.signer_verified
    # claiming to be bob with alice's signature
    with pytest.raises(InvalidRecord, match="bad signature") as info:
        open_submission(canonical_json({**obj, "signer": BOB.peer_id}), run_id=RUN, now=NOW)
    assert info.value.signer == BOB.peer_id


def test_header_must_name_its_signer() -> None:
    with pytest.raises(InvalidRecord, match="differs from its signer") as info:
        open_submission(raw_sealed(header_body(BOB)), run_id=RUN, now=NOW)
    assert info.value.signer == ALICE.peer_id and info.value.signer_verified
    with pytest.raises(ValueError, match="signing identity"):
        seal_submission(ALICE, RUN, header(BOB))


def test_wrong_run_kind_and_future_timestamp() -> None:
    raw = seal_submission(ALICE, RUN, header(), ts=NOW)
    with pytest.raises(InvalidRecord, match="expected") as info:
        open_submission(raw, run_id="cd" * 32, now=NOW)
    assert info.value.signer == ALICE.peer_id
    heartbeat = seal(ALICE, "heartbeat", RUN, header_body(), ts=NOW)
    with pytest.raises(InvalidRecord, match="expected a 'submission'"):
        open_submission(heartbeat, run_id=RUN, now=NOW)
    with pytest.raises(InvalidRecord, match="future") as info:
        open_submission(raw, run_id=RUN, now=NOW - 121)
    assert info.value.signer_verified
    assert open_submission(raw, run_id=RUN, now=NOW - 300, max_skew=600).header == header()


def test_oversized_is_refused_before_parsing() -> None:
    many = [{"index": i, "digest": "ab" * 32, "nbytes": 2**40} for i in range(1024)]
    raw = raw_sealed(header_body(fragments=many))
    assert len(raw) > MAX_SUBMISSION_HEADER_BYTES
    with pytest.raises(InvalidRecord, match="too large"):
        open_submission(raw, run_id=RUN, now=NOW)
    with pytest.raises(InvalidRecord, match="too large"):
        open_submission(b"{" * (MAX_SUBMISSION_HEADER_BYTES + 1), run_id=RUN, now=NOW)
    with pytest.raises(ValueError, match="limit"):
        seal_submission(ALICE, RUN, header(fragments=many))
    # about 140 worst-case fragment references fit
    fits = [{"index": i, "digest": "ab" * 32, "nbytes": 2**40} for i in range(128)]
    assert (
        open_submission(
            seal_submission(ALICE, RUN, header(fragments=fits), ts=NOW), run_id=RUN, now=NOW
        )
        .header.fragments[-1]
        .index
        == 127
    )


def test_malformed_bytes() -> None:
    for raw in (b"not json", b"[]", b'{"b":1, "a":2}', b"\xff"):
        with pytest.raises(InvalidRecord):
            open_submission(raw, run_id=RUN, now=NOW)


def _frag(i: int, **over: Any) -> dict[str, Any]:
    return {"index": i, "digest": "ab" * 32, "nbytes": 10, **over}


@pytest.mark.parametrize(
    ("over", "where"),
    [
        ({"loss": -0.5}, "loss"),
        ({"loss": 1e5}, "loss"),
        ({"loss": "3.2"}, "loss"),
        ({"steps": 0}, "steps"),
        ({"steps": True}, "steps"),
        ({"steps": 10**9 + 1}, "steps"),
        ({"tokens": 0}, "tokens"),
        ({"tokens": 10**15 + 1}, "tokens"),
        ({"base_version": -1}, "base_version"),
        ({"base_version": 2**63}, "base_version"),
        ({"codec": "INT4"}, "codec"),
        ({"codec": ""}, "codec"),
        ({"codec": "x" * 33}, "codec"),
        ({"fragments": []}, "fragments"),
        ({"fragments": [_frag(2), _frag(1)]}, "increasing"),
        ({"fragments": [_frag(1), _frag(1)]}, "increasing"),
        ({"fragments": [_frag(1024)]}, "fragments.0.index"),
        ({"fragments": [_frag(-1)]}, "fragments.0.index"),
        ({"fragments": [_frag(0, digest="AB" * 32)]}, "fragments.0.digest"),
        ({"fragments": [_frag(0, digest="ab" * 31)]}, "fragments.0.digest"),
        ({"fragments": [_frag(0, nbytes=2**40 + 1)]}, "fragments.0.nbytes"),
        ({"fragments": [_frag(0, extra=1)]}, "fragments.0.extra"),
        ({"fragments": {"0": _frag(0)}}, "fragments"),
        ({"peer_id": "12D3KooWnotapeerid"}, "peer_id"),
        ({"extra": 1}, "extra"),
    ],
)
def test_schema_rejections_name_the_signer(over: dict[str, Any], where: str) -> None:
    with pytest.raises(InvalidRecord, match=f"bad submission: .*{where}") as info:
        open_submission(raw_sealed(header_body(**over)), run_id=RUN, now=NOW)
    assert info.value.signer == ALICE.peer_id


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_loss_is_refused_everywhere(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        header(loss=bad)
    with pytest.raises(ValueError):
        raw_sealed(header_body(loss=bad))  # canonical JSON has no NaN/Infinity
    # hand-built bytes carrying NaN (or 1e999, which parses to inf) never reach the schema
    obj = json.loads(raw_sealed(header_body()))
    for token in ("NaN", "Infinity", "1e999"):
        text = json.dumps(
            {**obj, "body": header_body(loss=0.125)}, sort_keys=True, separators=(",", ":")
        ).replace("0.125", token)
        with pytest.raises(InvalidRecord, match="JSON") as info:
            open_submission(text.encode(), run_id=RUN, now=NOW)
        assert info.value.signer is None  # nothing verified, nobody named


def test_signed_message_is_domain_separated_from_other_kinds() -> None:
    raw = seal_submission(ALICE, RUN, header(), ts=NOW)
    obj = json.loads(raw)
    unsigned = canonical_json({k: v for k, v in obj.items() if k != "sig"})
    assert ALICE.sign(signing_message(SUBMISSION_KIND, RUN, unsigned)).hex() == obj["sig"]
    assert signing_message("heartbeat", RUN, unsigned) != signing_message(
        SUBMISSION_KIND, RUN, unsigned
    )


def test_a_data_version_lies_near_the_base_and_is_omitted_when_none() -> None:
    """ADR 0066: the rows a delta trained on are those of a version from DATA_LAG before its
    base to the one after it (a stretch that read ahead); without one the bytes are as before."""
    plain = open_submission(seal_submission(ALICE, RUN, header(), ts=NOW), run_id=RUN, now=NOW)
    assert "data_version" not in plain.envelope.body
    assert header().rows_version == 7
    for ok in (7 - DATA_LAG, 7, 8):
        assert header(data_version=ok).rows_version == ok
    for bad in (7 - DATA_LAG - 1, 9):
        with pytest.raises(InvalidRecord, match="data version"):
            open_submission(raw_sealed(header_body(data_version=bad)), run_id=RUN, now=NOW)
