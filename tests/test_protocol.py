"""Identity, signed envelopes and record bodies: every rejection path, plus peer ids checked
against py-libp2p and hivemind's p2pd (each in its own interpreter, see docs/adr/0001)."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from p2pdiloco.errors import UserError
from p2pdiloco.protocol import records
from p2pdiloco.protocol.identity import (
    Identity,
    IdentityError,
    b58decode,
    b58encode,
    default_identity_path,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify,
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
# identity


def test_identity_save_load_roundtrip_mode_0600(tmp_path: Path, alice: Identity) -> None:
    path = tmp_path / "deep" / "dir" / "identity.key"
    alice.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    raw = path.read_bytes()
    assert raw[:4] == b"\x08\x01\x12\x40" and len(raw) == 68
    assert raw[4:] == alice.seed + alice.public_key
    loaded = Identity.load(path)
    assert loaded.peer_id == alice.peer_id and loaded.seed == SEED
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temp left behind


def test_save_refuses_overwrite(tmp_path: Path, alice: Identity, bob: Identity) -> None:
    path = tmp_path / "identity.key"
    alice.save(path)
    with pytest.raises(IdentityError, match="already exists"):
        bob.save(path)
    assert Identity.load(path).peer_id == alice.peer_id
    bob.save(path, overwrite=True)
    assert Identity.load(path).peer_id == bob.peer_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity.key"]


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"garbage",
        b"\x08\x01\x12\x40" + bytes(63),  # truncated
        b"\x08\x00\x12\x40" + bytes(64),  # RSA key type
        b"\x08\x01\x12\x20" + bytes(32),  # seed only (py-libp2p style), not seed||pub
        b"\x08\x01\x12\x40" + SEED + bytes(32),  # public half does not match the seed
        b"\x08\x01\x12\x40" + bytes(64) + b"\x18\x01",  # unknown trailing field
        b"\x08\x01\x08\x01\x12\x40" + bytes(64),  # repeated field
    ],
)
def test_corrupt_key_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError) as info:
        Identity.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, UserError)


def test_missing_key_file_and_group_readable_warning(
    tmp_path: Path, alice: Identity, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(IdentityError, match="does not exist"):
        Identity.load(tmp_path / "nope.key")
    path = tmp_path / "identity.key"
    alice.save(path)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING):
        Identity.load(path)
    assert "readable by other users" in caplog.text


def test_load_or_create_and_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    path = default_identity_path()
    assert path == tmp_path / "xdg" / "p2pdiloco" / "identity.key"
    first = Identity.load_or_create()
    assert path.exists()
    assert Identity.load_or_create().peer_id == first.peer_id
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_identity_path() == Path.home() / ".local/share/p2pdiloco/identity.key"


def test_peer_id_format_and_roundtrip(alice: Identity) -> None:
    assert alice.peer_id.startswith("12D3KooW")
    assert alice.marshal_public_key() == b"\x08\x01\x12\x20" + alice.public_key
    assert public_key_from_peer_id(alice.peer_id) == alice.public_key
    assert peer_id_from_public_key(alice.public_key) == alice.peer_id
    assert alice.public_key_hex == alice.public_key.hex()
    fresh = Identity.generate()
    assert public_key_from_peer_id(fresh.peer_id) == fresh.public_key
    assert b58decode(b58encode(b"\x00\x00\x01\x02")) == b"\x00\x00\x01\x02"
    for bad in ["", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "12D3KooW0OIl", 5]:
        with pytest.raises(IdentityError):
            public_key_from_peer_id(bad)  # type: ignore[arg-type]


def test_sign_and_verify(alice: Identity, bob: Identity) -> None:
    sig = alice.sign(b"hello")
    assert len(sig) == 64
    assert verify(alice.public_key, b"hello", sig)
    assert not verify(alice.public_key, b"hellO", sig)
    assert not verify(bob.public_key, b"hello", sig)
    assert not verify(b"short", b"hello", sig)
    assert not verify(alice.public_key, b"hello", sig[:10])
    assert not verify(None, b"hello", sig)  # type: ignore[arg-type]


def _run_fresh(code: str, timeout: float = 60) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_peer_id_matches_py_libp2p(alice: Identity) -> None:
    out = _run_fresh(
        f"""
        from libp2p.crypto.ed25519 import Ed25519PrivateKey
        from libp2p.peer.id import ID
        k = Ed25519PrivateKey.from_bytes({alice.seed!r})
        pub = k.get_public_key()
        assert pub.serialize() == {alice.marshal_public_key()!r}
        assert ID.from_base58({alice.peer_id!r}).extract_public_key().to_bytes() == {alice.public_key!r}
        print(ID.from_pubkey(pub).to_base58())
        """
    )
    assert out == alice.peer_id


def test_key_file_accepted_by_hivemind_p2pd(tmp_path: Path, alice: Identity) -> None:
    # The real go-libp2p daemon reads our key file and reports its peer id: proves the file
    # format and the peer id on the hivemind side at once.
    path = tmp_path / "identity.key"
    alice.save(path)
    out = _run_fresh(
        f"""
        import asyncio
        from hivemind.p2p import P2P

        async def main():
            p2p = await P2P.create(
                identity_path={str(path)!r}, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                nat_port_map=False, auto_nat=False, use_relay=False,
            )
            try:
                print(p2p.peer_id.to_base58())
            finally:
                await p2p.shutdown()

        asyncio.run(main())
        """
    )
    assert out == alice.peer_id


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
