"""The DHT validator checks what a record means, not only who signed it (no network)."""

from __future__ import annotations

import logging
import time

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.net import keys
from p2pdiloco.net.cert_records import certs_key
from p2pdiloco.net.dht import EnvelopeValidator, _dht_key
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.net.record_rules import RecordRefused, RejectionLog
from p2pdiloco.protocol.certificates import CertificateBody, assemble, sign_body
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import Hardware, Heartbeat, IslandRendezvous, run_id_of_body
from p2pdiloco.protocol.signing import PROTOCOL_VERSION, open_envelope, seal

NOW = 1_900_000_000.0
TEN_YEARS = 10 * 365 * 86400.0
ALICE, MALLORY = Identity.generate(), Identity.generate()
RUN_ID, MANIFEST, MANIFEST_RAW = create_manifest(
    ALICE, name="r", model="gemma-tiny", data="embedded", seed=0, inner_steps=4, committee_size=1
)


def heartbeat(ident: Identity, run_id: str, ts: float = NOW, peer_id: str | None = None) -> bytes:
    hb = Heartbeat(
        peer_id=peer_id or ident.peer_id,
        island="i",
        roles=["learner"],
        hardware=Hardware(device="cpu", name="x", memory_gb=1.0, count=1),
        throughput_tps=0.0,
        version=0,
        addrs=[],
        gossip_addrs=[],
        reachability="unknown",
        seq=1,
    )
    return seal(ident, "heartbeat", run_id, hb.model_dump(mode="json"), ts=ts)


def cert_record(signer: Identity, version: int, claimed: int | None = None) -> bytes:
    """A self-elected one-member committee's certificate (passes its own quorum check)."""
    body = CertificateBody(
        run=RUN_ID,
        version=version,
        base_version=version - 1,
        state_hash="0" * 64,
        committee=[signer.peer_id],
        quorum=1,
        accepted=[],
        roster_hash="0" * 64,
    )
    cert = assemble(body, {signer.peer_id: sign_body(signer, body)})
    import json

    body_out = {"version": version if claimed is None else claimed, "cert": json.loads(cert)}
    return seal(signer, "certificate", RUN_ID, body_out, ts=NOW)


def record(key: str, subkey: str, raw: bytes, expiry: float) -> DHTRecord:
    return DHTRecord(
        _dht_key(key), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(raw), expiry
    )


def refusal(rec: DHTRecord, validator: EnvelopeValidator | None = None) -> Reason | None:
    try:
        (validator or EnvelopeValidator()).check(rec, now=NOW)
    except RecordRefused as e:
        return e.code
    return None


PEERS = keys.run_peers_key(RUN_ID)


def test_valid_records_are_stored() -> None:
    manifest = MANIFEST_RAW
    assert refusal(record(keys.runs_key(), RUN_ID, manifest, NOW + keys.MANIFEST_TTL)) is None
    model_key = keys.model_runs_key("gemma-tiny")
    assert refusal(record(model_key, RUN_ID, manifest, NOW + 60)) is None
    assert refusal(record(PEERS, ALICE.peer_id, heartbeat(ALICE, RUN_ID), NOW + 30)) is None
    boot = heartbeat(ALICE, "")
    assert refusal(record(keys.bootstraps_key(), ALICE.peer_id, boot, NOW + 30)) is None
    cert = cert_record(ALICE, 3)
    assert refusal(record(certs_key(RUN_ID), ALICE.peer_id, cert, NOW + 3600)) is None


def test_squatted_manifest_slot_is_refused() -> None:
    """The issue's attack: the run's slot taken by another signed record, 10-year expiry."""
    squat = seal(MALLORY, "manifest", "", {"name": "x", "protocol_version": PROTOCOL_VERSION})
    assert refusal(record(keys.runs_key(), RUN_ID, squat, NOW + 60)) is Reason.MALFORMED
    other_id, _, other = create_manifest(
        MALLORY,
        name="m",
        model="gemma-tiny",
        data="embedded",
        seed=1,
        inner_steps=4,
        committee_size=1,
    )
    assert refusal(record(keys.runs_key(), RUN_ID, other, NOW + 60)) is Reason.WRONG_SLOT
    assert refusal(record(keys.runs_key(), other_id, other, NOW + TEN_YEARS)) is Reason.BAD_EXPIRY
    wrong_model = keys.model_runs_key("gemma-small")
    assert refusal(record(wrong_model, other_id, other, NOW + 60)) is Reason.WRONG_SLOT
    hb = heartbeat(MALLORY, RUN_ID)
    assert refusal(record(keys.runs_key(), RUN_ID, hb, NOW + 30)) is Reason.WRONG_SLOT


def test_manifest_of_another_protocol_needs_its_hash_and_its_creator() -> None:
    body = {
        "protocol_version": PROTOCOL_VERSION + 1,
        "name": "f",
        "model": "gemma-small",
        "creator": MALLORY.peer_id,
    }
    raw = seal(MALLORY, "manifest", "", body)
    rid = run_id_of_body(open_envelope(raw).body)
    assert refusal(record(keys.runs_key(), rid, raw, NOW + 60)) is None
    assert refusal(record(keys.model_runs_key("gemma-small"), rid, raw, NOW + 60)) is None
    assert refusal(record(keys.runs_key(), "e" * 64, raw, NOW + 60)) is Reason.WRONG_SLOT
    forged = seal(MALLORY, "manifest", "", {**body, "creator": ALICE.peer_id})
    rid = run_id_of_body(open_envelope(forged).body)
    assert refusal(record(keys.runs_key(), rid, forged, NOW + 60)) is Reason.WRONG_SIGNER


def test_replayed_heartbeat_with_a_long_expiry_is_refused() -> None:
    old = heartbeat(ALICE, RUN_ID, ts=NOW - 3600)
    assert refusal(record(PEERS, ALICE.peer_id, old, NOW + 30)) is Reason.BAD_TIMESTAMP
    fresh = heartbeat(ALICE, RUN_ID)
    assert refusal(record(PEERS, ALICE.peer_id, fresh, NOW + TEN_YEARS)) is Reason.BAD_EXPIRY
    # within the TTL from now, but further than the TTL from when it was signed
    aged = heartbeat(ALICE, RUN_ID, ts=NOW - keys.MAX_HEARTBEAT_TTL - 100)
    expiry = NOW + keys.MAX_HEARTBEAT_TTL
    assert refusal(record(PEERS, ALICE.peer_id, aged, expiry)) is Reason.BAD_EXPIRY


@pytest.mark.parametrize(
    ("raw", "key", "subkey", "code"),
    [
        (
            heartbeat(MALLORY, RUN_ID, peer_id=ALICE.peer_id),
            PEERS,
            ALICE.peer_id,
            Reason.WRONG_SIGNER,
        ),
        (heartbeat(MALLORY, RUN_ID), PEERS, ALICE.peer_id, Reason.WRONG_SLOT),
        (heartbeat(MALLORY, "f" * 64), PEERS, MALLORY.peer_id, Reason.WRONG_SLOT),
        (heartbeat(MALLORY, RUN_ID, ts=NOW + 3600), PEERS, MALLORY.peer_id, Reason.BAD_TIMESTAMP),
        (seal(MALLORY, "ban", RUN_ID, {}), PEERS, MALLORY.peer_id, Reason.UNKNOWN_KIND),
        (
            cert_record(MALLORY, 10**9, claimed=5),
            certs_key(RUN_ID),
            MALLORY.peer_id,
            Reason.UNVERIFIED,
        ),
        (cert_record(MALLORY, 2), certs_key(RUN_ID), ALICE.peer_id, Reason.WRONG_SLOT),
        (b"not an envelope", PEERS, MALLORY.peer_id, Reason.INVALID_SIGNATURE),
    ],
    # Stable ids (the keys are random): pytest-xdist workers must collect the same tests.
    ids=[
        "other-signer",
        "other-slot",
        "other-run",
        "future",
        "unknown-kind",
        "unverified-cert",
        "cert-other-slot",
        "not-an-envelope",
    ],
)
def test_records_that_lie_about_their_slot_signer_or_time(
    raw: bytes, key: str, subkey: str, code: Reason
) -> None:
    assert refusal(record(key, subkey, raw, NOW + 20)) is code


def test_certificate_without_a_quorum_of_its_committee_is_refused() -> None:
    import json

    env = json.loads(cert_record(MALLORY, 7))
    env["body"]["cert"]["sigs"] = {}
    raw = seal(MALLORY, "certificate", RUN_ID, env["body"], ts=NOW)
    assert refusal(record(certs_key(RUN_ID), MALLORY.peer_id, raw, NOW + 60)) is Reason.UNVERIFIED


def test_one_signer_fills_a_bounded_number_of_slots() -> None:
    validator = EnvelopeValidator(max_slots=2)
    for i in range(2):
        ident_key = keys.run_peers_key(f"{i:064x}")
        raw = heartbeat(MALLORY, f"{i:064x}")
        assert refusal(record(ident_key, MALLORY.peer_id, raw, NOW + 20), validator) is None
    raw = heartbeat(MALLORY, f"{9:064x}")
    rec = record(keys.run_peers_key(f"{9:064x}"), MALLORY.peer_id, raw, NOW + 20)
    assert refusal(rec, validator) is Reason.OVER_QUOTA


def test_repeated_rejections_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    rejections = RejectionLog(interval=60.0, max_keys=3)
    with caplog.at_level(logging.WARNING):
        logged = [
            rejections.warn("record", "peer", Reason.BAD_EXPIRY, "x", now=t) for t in range(50)
        ]
        assert logged == [True] + [False] * 49
        assert rejections.warn("record", "peer", Reason.BAD_EXPIRY, "x", now=61.0)
    assert "(+49 more like it)" in caplog.text
    assert "[bad_expiry]" in caplog.text
    for i in range(100):  # fresh identities cannot grow the map
        rejections.warn("record", f"sybil{i}", Reason.WRONG_SLOT, "x", now=100.0)
    assert len(rejections._seen) == 3


def test_validator_uses_the_local_clock_by_default() -> None:
    raw = heartbeat(ALICE, RUN_ID, ts=time.time())
    rec = record(PEERS, ALICE.peer_id, raw, time.time() + 30)
    assert EnvelopeValidator().validate(rec)


def island_record(
    ident: Identity, ts: float = NOW, peer_id: str | None = None, store: str = "10.0.0.2:29500"
) -> bytes:
    rdv = IslandRendezvous(
        peer_id=peer_id or ident.peer_id, island="lab", store=store, backend="gloo", ranks=2
    )
    return seal(ident, "island", RUN_ID, rdv.model_dump(mode="json"), ts=ts)


def test_an_island_rendezvous_sits_only_in_its_signer_s_slot_and_stays_fresh() -> None:
    islands = keys.run_islands_key(RUN_ID)
    assert refusal(record(islands, ALICE.peer_id, island_record(ALICE), NOW + 30)) is None
    spoke_for = island_record(MALLORY, peer_id=ALICE.peer_id)
    assert refusal(record(islands, ALICE.peer_id, spoke_for, NOW + 30)) is Reason.WRONG_SIGNER
    mine = island_record(MALLORY)
    assert refusal(record(islands, ALICE.peer_id, mine, NOW + 30)) is Reason.WRONG_SLOT
    assert refusal(record(PEERS, MALLORY.peer_id, mine, NOW + 30)) is Reason.WRONG_SLOT
    stale = island_record(ALICE, ts=NOW - 3600)
    assert refusal(record(islands, ALICE.peer_id, stale, NOW + 30)) is Reason.BAD_TIMESTAMP
    assert refusal(record(islands, ALICE.peer_id, island_record(ALICE), NOW + TEN_YEARS)) is (
        Reason.BAD_EXPIRY
    )
    with pytest.raises(ValueError, match="store"):
        island_record(ALICE, store="10.0.0.2:29500; rm -rf /")
