"""Signed envelopes and record bodies: every rejection path (identities: test_identity.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from p2pdiloco.errors import UserError
from p2pdiloco.protocol import records
from p2pdiloco.protocol.identity import (
    Identity,
)
from p2pdiloco.protocol.records import (
    IncompatibleProtocol,
    RunManifest,
    SyncRules,
    default_quorum,
    parse_heartbeat,
    parse_manifest,
    run_id_of,
)
from p2pdiloco.protocol.signing import (
    PROTOCOL_VERSION,
    Envelope,
    InvalidRecord,
    ReplayGuard,
    canonical_json,
    open_envelope,
    seal,
    signing_message,
)

SEED = bytes(range(32))
RUN = "ab" * 32
NOW = 1_800_000_000.0


@pytest.fixture
def alice() -> Identity:
    return Identity.from_seed(SEED)


@pytest.fixture
def bob() -> Identity:
    return Identity.from_seed(b"\x07" * 32)


def _heartbeat_body(ident: Identity, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "peer_id": ident.peer_id,
        "island": "lab-1",
        "roles": ["learner", "syncer"],
        "hardware": {"device": "cuda", "name": "H100", "memory_gb": 80.0, "count": 8},
        "throughput_tps": 12345.5,
        "version": 3,
        "addrs": ["/ip4/127.0.0.1/tcp/4001"],
        "gossip_addrs": ["/ip4/127.0.0.1/tcp/4002"],
        "reachability": "direct",
        "seq": 1,
    }
    body.update(over)
    return body


def _manifest_body(ident: Identity, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "tiny-run.v1",
        "model": "gpt-tiny",
        "data": "embedded",
        "seed": 42,
        "creator": ident.peer_id,
        "created_at": NOW,
        "committee_size": 4,
        "inner_steps": 500,
        "inner": {"lr": 4e-4, "batch_size": 8, "seq_len": 128},
        "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True, "fragments": 1},
    }
    body.update(over)
    return body


def _resign(ident: Identity, obj: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in obj.items() if k != "sig"}
    sig = ident.sign(signing_message(obj["kind"], obj["run"], canonical_json(unsigned)))
    return canonical_json({**unsigned, "sig": sig.hex()})


# ---------------------------------------------------------------------------------------------
# envelopes


def test_seal_open_roundtrip(alice: Identity) -> None:
    raw = seal(alice, "heartbeat", RUN, {"b": [1, 2], "a": "é"}, ts=NOW)
    env = open_envelope(raw, kind="heartbeat", run_id=RUN, now=NOW)
    assert isinstance(env, Envelope)
    assert (env.kind, env.run, env.signer, env.ts) == ("heartbeat", RUN, alice.peer_id, NOW)
    assert env.body == {"a": "é", "b": [1, 2]}
    assert env.public_key == alice.public_key and env.raw == raw
    obj = json.loads(raw)
    assert set(obj) == {"v", "kind", "run", "signer", "ts", "body", "sig"} and obj["v"] == 1
    # default ts is now
    assert abs(open_envelope(seal(alice, "x", "", {})).ts - time.time()) < 5


def test_oversized_rejected_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    import p2pdiloco.protocol.signing as signing

    def no_parsing(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed an oversized record")

    monkeypatch.setattr(signing.json, "loads", no_parsing)
    garbage = b'{"a":"' + b"x" * (10 * 1024 * 1024) + b'"}'
    start = time.perf_counter()
    with pytest.raises(InvalidRecord, match="too large"):
        open_envelope(garbage)
    # generous bound: a length check, not a parse (which the patch above would catch anyway)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xff\xfe not utf-8", "not UTF-8"),
        (b"not json", "not valid JSON"),
        (b"[1,2]", "not a JSON object"),
        (b'{"a":NaN}', "not valid JSON"),
        (b'{"a":1,"a":2}', "not valid JSON"),
        (b"[" * 50_000 + b"]" * 50_000, "not valid JSON"),
        (b'{"a":1e999}', "outside canonical JSON"),
        (b'{"b":1, "a":2}', "canonical"),
    ],
)
def test_malformed_rejected(raw: bytes, reason: str) -> None:
    with pytest.raises(InvalidRecord, match=reason):
        open_envelope(raw, max_bytes=1 << 20)


def test_non_bytes_rejected() -> None:
    with pytest.raises(InvalidRecord, match="must be bytes"):
        open_envelope("{}")  # type: ignore[arg-type]


def test_schema_extra_field_and_bad_fields(alice: Identity) -> None:
    obj = json.loads(seal(alice, "heartbeat", RUN, {}, ts=NOW))
    for mutate, where in [
        (lambda o: o.__setitem__("extra", 1), "extra"),
        (lambda o: o.__setitem__("v", 2), "v"),
        (lambda o: o.__setitem__("signer", "12D3KooWnotapeerid"), "signer"),
        (lambda o: o.__setitem__("ts", "soon"), "ts"),
        (lambda o: o.__setitem__("sig", "zz"), "sig"),
        (lambda o: o.pop("body"), "body"),
    ]:
        bad = dict(obj)
        mutate(bad)
        with pytest.raises(InvalidRecord, match=f"bad envelope: {where}"):
            open_envelope(canonical_json(bad), now=NOW)


def test_wrong_kind_and_run(alice: Identity) -> None:
    raw = seal(alice, "heartbeat", RUN, {}, ts=NOW)
    with pytest.raises(InvalidRecord, match="expected a 'manifest'"):
        open_envelope(raw, kind="manifest", now=NOW)
    with pytest.raises(InvalidRecord, match="expected"):
        open_envelope(raw, run_id="cd" * 32, now=NOW)


@pytest.mark.parametrize("field", ["run", "kind"])
def test_relabelled_without_resigning_is_bad_signature(alice: Identity, field: str) -> None:
    obj = json.loads(seal(alice, "heartbeat", RUN, {}, ts=NOW))
    obj[field] = "other"
    with pytest.raises(InvalidRecord, match="bad signature") as info:
        open_envelope(canonical_json(obj), now=NOW)
    assert info.value.signer == alice.peer_id and not info.value.signer_verified


def test_forged_body_and_swapped_signer(alice: Identity, bob: Identity) -> None:
    obj = json.loads(seal(alice, "heartbeat", RUN, {"tokens": 1}, ts=NOW))
    forged = {**obj, "body": {"tokens": 10**9}}
    with pytest.raises(InvalidRecord, match="bad signature"):
        open_envelope(canonical_json(forged), now=NOW)
    swapped = {**obj, "signer": bob.peer_id}
    with pytest.raises(InvalidRecord, match="bad signature") as info:
        open_envelope(canonical_json(swapped), now=NOW)
    assert info.value.signer == bob.peer_id
    # bob re-signing alice's content is fine: it is then bob's record
    assert open_envelope(_resign(bob, swapped), now=NOW).signer == bob.peer_id


def test_signature_is_domain_separated() -> None:
    body = b"{}"
    assert signing_message("a", "bc", body) != signing_message("ab", "c", body)
    assert signing_message("k", "r1", body) != signing_message("k", "r2", body)


def test_timestamps(alice: Identity) -> None:
    future = seal(alice, "heartbeat", RUN, {}, ts=NOW + 121)
    with pytest.raises(InvalidRecord, match="future") as info:
        open_envelope(future, now=NOW)
    assert info.value.signer_verified
    assert open_envelope(seal(alice, "heartbeat", RUN, {}, ts=NOW + 100), now=NOW)
    old = seal(alice, "heartbeat", RUN, {}, ts=NOW - 600)
    assert open_envelope(old, now=NOW).ts == NOW - 600  # no max_age: accepted
    with pytest.raises(InvalidRecord, match="too old"):
        open_envelope(old, now=NOW, max_age=300)


def test_seal_rejects_unrepresentable(alice: Identity) -> None:
    with pytest.raises(ValueError):
        seal(alice, "x", RUN, {"a": float("nan")})
    with pytest.raises(ValueError):
        seal(alice, "", RUN, {})
    with pytest.raises(TypeError):
        seal(alice, "x", RUN, {"a": object()})


def test_replay_guard(alice: Identity, bob: Identity) -> None:
    guard = ReplayGuard(max_keys=2)
    first = open_envelope(seal(alice, "heartbeat", RUN, {}, ts=NOW), now=NOW)
    guard.check(first)
    with pytest.raises(InvalidRecord, match="replayed"):
        guard.check(first)
    older = open_envelope(seal(alice, "heartbeat", RUN, {}, ts=NOW - 1), now=NOW)
    with pytest.raises(InvalidRecord, match="replayed"):
        guard.check(older)
    guard.check(open_envelope(seal(alice, "heartbeat", RUN, {}, ts=NOW + 1), now=NOW))
    # other kind, run or signer: independent
    guard.check(open_envelope(seal(alice, "cert", RUN, {}, ts=NOW), now=NOW))
    guard.check(open_envelope(seal(bob, "heartbeat", RUN, {}, ts=NOW), now=NOW))
    assert len(guard) == 2  # bounded: the oldest key was evicted


# ---------------------------------------------------------------------------------------------
# records


def test_heartbeat_parse_and_signer_binding(alice: Identity, bob: Identity) -> None:
    env = open_envelope(seal(alice, "heartbeat", RUN, _heartbeat_body(alice), ts=NOW), now=NOW)
    hb = parse_heartbeat(env)
    assert hb.peer_id == alice.peer_id and hb.hardware.count == 8
    lying = seal(alice, "heartbeat", RUN, _heartbeat_body(bob), ts=NOW)
    with pytest.raises(InvalidRecord, match="differs from its signer"):
        parse_heartbeat(open_envelope(lying, now=NOW))


@pytest.mark.parametrize(
    "over",
    [
        {"roles": ["learner", "learner"]},
        {"roles": ["admin"]},
        {"island": "x" * 65},
        {"island": "evil\x1b[2J"},
        {"throughput_tps": -1.0},
        {"version": -1},
        {"addrs": ["/ip4/1.2.3.4/tcp/1"] * 33},
        {"addrs": ["not-a-multiaddr"]},
        {"reachability": "maybe"},
        {"seq": True},
        {"hardware": {"device": "cuda", "name": "x", "memory_gb": 1.0, "count": 1, "x": 1}},
        {"extra": 1},
    ],
)
def test_heartbeat_schema_rejections(alice: Identity, over: dict[str, Any]) -> None:
    env = open_envelope(
        seal(alice, "heartbeat", RUN, _heartbeat_body(alice, **over), ts=NOW), now=NOW
    )
    with pytest.raises(InvalidRecord, match="bad heartbeat"):
        parse_heartbeat(env)


def test_manifest_parse_and_defaults(alice: Identity) -> None:
    env = open_envelope(seal(alice, "manifest", "", _manifest_body(alice), ts=NOW), now=NOW)
    run_id, manifest = parse_manifest(env)
    assert len(run_id) == 64 and int(run_id, 16) >= 0
    assert manifest.quorum == default_quorum(4) == 3
    assert manifest.compression == "none" and manifest.rules == SyncRules()  # test_sync_rules
    assert manifest.inner.beta2 == 0.95 and manifest.outer.nesterov is True
    assert [default_quorum(k) for k in (1, 2, 3, 4, 7, 64)] == [1, 2, 3, 3, 5, 43]


def test_run_id_stable_across_key_order_and_sensitive_to_fields(alice: Identity) -> None:
    body = _manifest_body(alice)
    base = run_id_of(RunManifest.model_validate(body))
    reordered = dict(reversed(list(body.items())))
    assert run_id_of(RunManifest.model_validate(reordered)) == base
    # the quorum default is part of the id: spelling it out changes nothing
    assert run_id_of(RunManifest.model_validate({**body, "quorum": 3})) == base
    changes = {
        "name": "other",
        "seed": 43,
        "created_at": NOW + 1,
        "committee_size": 5,
        "quorum": 4,
        "inner_steps": 501,
        "inner": {"lr": 3e-4},
        "outer": {"fragments": 2},
        "compression": "int4",
        "rules": {"staleness": 3},
    }
    ids = {run_id_of(RunManifest.model_validate({**body, k: v})) for k, v in changes.items()}
    assert base not in ids and len(ids) == len(changes)


def test_manifest_rejections(alice: Identity, bob: Identity) -> None:
    def parse(body: dict[str, Any], run: str = "") -> Any:
        return parse_manifest(open_envelope(seal(alice, "manifest", run, body, ts=NOW), now=NOW))

    with pytest.raises(InvalidRecord, match="creator differs"):
        parse(_manifest_body(bob))
    with pytest.raises(InvalidRecord, match="run field must be empty"):
        parse(_manifest_body(alice), run=RUN)
    with pytest.raises(InvalidRecord, match="quorum 5 exceeds"):
        parse(_manifest_body(alice, quorum=5))
    with pytest.raises(InvalidRecord, match="bad manifest: name"):
        parse(_manifest_body(alice, name="has space"))
    with pytest.raises(InvalidRecord, match="bad manifest: committee_size"):
        parse(_manifest_body(alice, committee_size=65))


def test_incompatible_protocol_version(alice: Identity) -> None:
    newer = _manifest_body(alice, protocol_version=PROTOCOL_VERSION + 1, future_field={"x": 1})
    env = open_envelope(seal(alice, "manifest", "", newer, ts=NOW), now=NOW)
    with pytest.raises(IncompatibleProtocol) as info:
        parse_manifest(env)
    msg = str(info.value)
    assert f"run 'tiny-run.v1' uses protocol version {PROTOCOL_VERSION + 1}" in msg
    assert f"speaks version {PROTOCOL_VERSION}" in msg and "pip install -U p2pdiloco" in msg
    assert isinstance(info.value, UserError)


def test_a_protocol_1_node_is_told_to_upgrade(
    alice: Identity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The envelope format did not change with the protocol, so a node of protocol 1 still
    opens a current manifest envelope and reaches the upgrade message."""
    raw = seal(alice, "manifest", "", _manifest_body(alice, rules={"staleness": 1}), ts=NOW)
    monkeypatch.setattr(records, "PROTOCOL_VERSION", 1)
    with pytest.raises(IncompatibleProtocol, match="pip install -U p2pdiloco") as info:
        parse_manifest(open_envelope(raw, now=NOW))
    assert f"uses protocol version {PROTOCOL_VERSION} but this p2pdiloco speaks version 1" in str(
        info.value
    )
