"""Identities: key files, peer ids, signatures; peer ids checked against py-libp2p and
hivemind's p2pd (each in its own interpreter, see docs/adr/0001)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from p2pdiloco.errors import UserError
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

SEED = bytes(range(32))


@pytest.fixture
def alice() -> Identity:
    return Identity.from_seed(SEED)


@pytest.fixture
def bob() -> Identity:
    return Identity.from_seed(b"\x07" * 32)


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
