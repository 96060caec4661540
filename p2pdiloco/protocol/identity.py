"""One ed25519 key per node: it yields the libp2p peer id on both stacks and signs every message.

The key file is the libp2p marshalled private key protobuf
(``PrivateKey{key_type=Ed25519, data=seed || public key}``), so the same file is a valid
go-libp2p ``p2pd -id`` identity file. The two protobuf messages involved are encoded by hand:
this module must never import hivemind, libp2p or google.protobuf (see docs/adr/0001).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path

import nacl.exceptions
import nacl.signing

from p2pdiloco.errors import UserError

log = logging.getLogger(__name__)

SEED_LEN = 32
PUBLIC_KEY_LEN = 32
SIGNATURE_LEN = 64
KEY_TYPE_ED25519 = 1
# A key file is 68 bytes; anything far bigger is not a key and is not read whole.
_MAX_KEY_FILE_BYTES = 4096

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}
# Identity multihash header: code 0x00, digest length 36 (= marshalled ed25519 public key).
_IDENTITY_MULTIHASH_PREFIX = b"\x00\x24"


class IdentityError(UserError):
    """A key file or peer id that is missing, corrupt or not an Ed25519 libp2p identity."""


# ---------------------------------------------------------------------------------------------
# base58btc (bitcoin alphabet, no multibase prefix)


def b58encode(data: bytes) -> str:
    """Encode bytes as base58btc; never raises."""
    n = int.from_bytes(data, "big")
    out: list[str] = []
    while n:
        n, rem = divmod(n, 58)
        out.append(_B58_ALPHABET[rem])
    leading_zeros = len(data) - len(data.lstrip(b"\x00"))
    return "1" * leading_zeros + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    """Decode base58btc; raises ValueError on a character outside the alphabet."""
    n = 0
    for ch in text:
        digit = _B58_INDEX.get(ch)
        if digit is None:
            raise ValueError(f"invalid base58 character {ch!r}")
        n = n * 58 + digit
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    leading_ones = len(text) - len(text.lstrip("1"))
    return b"\x00" * leading_ones + body


# ---------------------------------------------------------------------------------------------
# the two-field libp2p key protobuf: {key_type: varint field 1, data: bytes field 2}


def _encode_key_proto(key_type: int, data: bytes) -> bytes:
    # Both lengths we ever encode (32, 64) and the key type fit one varint byte.
    if key_type >= 0x80 or len(data) >= 0x80:
        raise ValueError("key protobuf field too large for this encoder")
    return bytes([0x08, key_type, 0x12, len(data)]) + data


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 64, 7):
        if pos >= len(buf):
            raise IdentityError("truncated varint in key protobuf")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise IdentityError("varint too long in key protobuf")


def _decode_key_proto(buf: bytes) -> tuple[int, bytes]:
    """Parse ``{key_type, data}``; raises IdentityError on anything else (unknown, repeated or
    missing fields, wrong wire types, trailing bytes)."""
    key_type: int | None = None
    data: bytes | None = None
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        if tag == 0x08 and key_type is None:
            key_type, pos = _read_varint(buf, pos)
        elif tag == 0x12 and data is None:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise IdentityError("truncated key data in key protobuf")
            data = bytes(buf[pos : pos + length])
            pos += length
        else:
            raise IdentityError(f"unexpected field tag {tag:#x} in key protobuf")
    if key_type is None or data is None:
        raise IdentityError("key protobuf lacks key_type or data")
    return key_type, data


# ---------------------------------------------------------------------------------------------
# peer ids


def marshal_public_key(public_key: bytes) -> bytes:
    """libp2p ``PublicKey{key_type=Ed25519, data}`` bytes; raises IdentityError if not 32 bytes."""
    if len(public_key) != PUBLIC_KEY_LEN:
        raise IdentityError(
            f"an Ed25519 public key is {PUBLIC_KEY_LEN} bytes, not {len(public_key)}"
        )
    return _encode_key_proto(KEY_TYPE_ED25519, public_key)


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id ("12D3KooW...") of an Ed25519 public key.

    Raises IdentityError if the key is not 32 bytes.
    """
    return b58encode(_IDENTITY_MULTIHASH_PREFIX + marshal_public_key(public_key))


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The 32-byte Ed25519 public key embedded in a peer id.

    Raises IdentityError if ``peer_id`` is not a base58 identity-multihash Ed25519 peer id
    (e.g. an RSA peer id, which only carries a hash of its key).
    """
    if not isinstance(peer_id, str) or not 40 <= len(peer_id) <= 64:
        raise IdentityError("not an Ed25519 peer id (bad length)")
    try:
        raw = b58decode(peer_id)
    except ValueError as e:
        raise IdentityError(f"not an Ed25519 peer id ({e})") from None
    if not raw.startswith(_IDENTITY_MULTIHASH_PREFIX) or len(raw) != 38:
        raise IdentityError("not an Ed25519 peer id (not an identity multihash of 36 bytes)")
    key_type, data = _decode_key_proto(raw[2:])
    if key_type != KEY_TYPE_ED25519 or len(data) != PUBLIC_KEY_LEN:
        raise IdentityError("not an Ed25519 peer id (wrong key type)")
    # Reject non-canonical spellings, so that one key has exactly one peer id string.
    if peer_id_from_public_key(data) != peer_id:
        raise IdentityError("not an Ed25519 peer id (non-canonical encoding)")
    return data


def verify(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``.

    Never raises: any malformed input (wrong types or lengths, bad point) yields False.
    """
    try:
        if len(public_key) != PUBLIC_KEY_LEN or len(signature) != SIGNATURE_LEN:
            return False
        nacl.signing.VerifyKey(bytes(public_key)).verify(bytes(message), bytes(signature))
    except (nacl.exceptions.CryptoError, TypeError, ValueError):
        return False
    return True


def verify_hex(peer_id: object, message: bytes, sig_hex: object) -> bool:
    """True iff ``sig_hex`` (128 lowercase hex: one text form per signature) is ``peer_id``'s
    valid signature of ``message``. Never raises: any malformed input from an untrusted
    certificate or vote (wrong types, a bad peer id or hex) is simply False."""
    if not isinstance(peer_id, str) or not isinstance(sig_hex, str) or len(sig_hex) != 128:
        return False
    if sig_hex.strip("0123456789abcdef"):
        return False
    try:
        return verify(public_key_from_peer_id(peer_id), message, bytes.fromhex(sig_hex))
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# the node identity


def default_identity_path() -> Path:
    """``$XDG_DATA_HOME/p2pdiloco/identity.key``, else ``~/.local/share/p2pdiloco/identity.key``."""
    base = os.environ.get("XDG_DATA_HOME")
    root = Path(base) if base else Path.home() / ".local" / "share"
    return root / "p2pdiloco" / "identity.key"


class Identity:
    """A node's Ed25519 signing key, its public key and libp2p peer id."""

    __slots__ = ("_peer_id", "_signing_key")

    def __init__(self, signing_key: nacl.signing.SigningKey) -> None:
        self._signing_key = signing_key
        self._peer_id = peer_id_from_public_key(bytes(signing_key.verify_key))

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(nacl.signing.SigningKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity of a 32-byte seed; raises IdentityError on another length."""
        if not isinstance(seed, bytes | bytearray) or len(seed) != SEED_LEN:
            raise IdentityError(f"an Ed25519 seed is {SEED_LEN} bytes")
        return cls(nacl.signing.SigningKey(bytes(seed)))

    @classmethod
    def from_private_key_bytes(cls, data: bytes) -> Identity:
        """Parse a marshalled libp2p private key.

        Raises IdentityError if it is not an Ed25519 key protobuf, or its embedded public key
        does not match its seed.
        """
        key_type, key = _decode_key_proto(data)
        if key_type != KEY_TYPE_ED25519:
            raise IdentityError(f"key type {key_type} is not Ed25519 (1)")
        if len(key) != SEED_LEN + PUBLIC_KEY_LEN:
            raise IdentityError(f"Ed25519 key data is {len(key)} bytes, expected 64")
        ident = cls.from_seed(key[:SEED_LEN])
        if ident.public_key != key[SEED_LEN:]:
            raise IdentityError("public key in key file does not match its seed")
        return ident

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Read a key file written by :meth:`save` (or by go-libp2p for an Ed25519 key).

        Raises IdentityError (one line, naming the path) if the file is missing, unreadable,
        corrupt or holds another key type. Logs a warning if group or others may read it.
        """
        p = Path(path)
        try:
            with open(p, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                data = f.read(_MAX_KEY_FILE_BYTES + 1)
        except FileNotFoundError:
            raise IdentityError(f"identity file {p} does not exist") from None
        except OSError as e:
            raise IdentityError(f"cannot read identity file {p}: {e.strerror or e}") from None
        if mode & 0o077:
            log.warning(
                "identity file %s is readable by other users (mode %o); run: chmod 600 %s",
                p,
                mode & 0o777,
                p,
            )
        if len(data) > _MAX_KEY_FILE_BYTES:
            raise IdentityError(f"identity file {p} is corrupt (too large for a key)")
        try:
            return cls.from_private_key_bytes(data)
        except IdentityError as e:
            raise IdentityError(
                f"identity file {p} is corrupt or not an Ed25519 key: {e}"
            ) from None

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the key file atomically with mode 0600, creating parent dirs with mode 0700.

        Raises IdentityError if the file exists and ``overwrite`` is false, or on an OS error.
        A crash at any moment leaves either no file or the complete file, never a partial one.
        """
        p = Path(path)
        try:
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise IdentityError(f"cannot create directory {p.parent}: {e.strerror or e}") from None
        if p.exists() and not overwrite:
            raise IdentityError(f"identity file {p} already exists; refusing to overwrite it")
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(8)}.tmp")
        try:
            # O_EXCL on a fresh name with 0600 from the start: the key is never world-readable,
            # not even between create and chmod.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                data = self.marshal_private_key()
                while data:
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            if overwrite:
                os.replace(tmp, p)
            else:
                _publish_no_clobber(tmp, p)
            _fsync_dir(p.parent)
        except OSError as e:
            raise IdentityError(f"cannot write identity file {p}: {e.strerror or e}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str] | None = None) -> Identity:
        """Load the key at ``path`` (default :func:`default_identity_path`), creating it if absent.

        Raises IdentityError if an existing file is corrupt (it is never replaced silently).
        """
        p = Path(path) if path is not None else default_identity_path()
        if p.exists():
            return cls.load(p)
        ident = cls.generate()
        try:
            ident.save(p)
        except IdentityError:
            # Another process created it first: use theirs so both agree on one identity.
            if p.exists():
                return cls.load(p)
            raise
        log.info("created new identity %s in %s", ident.peer_id, p)
        return ident

    @property
    def seed(self) -> bytes:
        """The 32-byte private seed."""
        return bytes(self._signing_key)

    @property
    def public_key(self) -> bytes:
        """The 32-byte Ed25519 public key."""
        return bytes(self._signing_key.verify_key)

    @property
    def public_key_hex(self) -> str:
        """The public key as 64 lowercase hex characters."""
        return self.public_key.hex()

    @property
    def peer_id(self) -> str:
        """The libp2p peer id ("12D3KooW...")."""
        return self._peer_id

    def sign(self, message: bytes) -> bytes:
        """A 64-byte detached Ed25519 signature of ``message``."""
        return bytes(self._signing_key.sign(bytes(message)).signature)

    def marshal_private_key(self) -> bytes:
        """libp2p ``PrivateKey{key_type=Ed25519, data=seed || public key}`` bytes (68 bytes)."""
        return _encode_key_proto(KEY_TYPE_ED25519, self.seed + self.public_key)

    def marshal_public_key(self) -> bytes:
        """libp2p ``PublicKey{key_type=Ed25519, data=public key}`` bytes (36 bytes)."""
        return marshal_public_key(self.public_key)

    def __repr__(self) -> str:
        return f"Identity({self._peer_id})"


def _publish_no_clobber(tmp: Path, dest: Path) -> None:
    """Move ``tmp`` to ``dest``; raises IdentityError if ``dest`` exists (checked atomically
    where the filesystem supports hard links), OSError on other failures."""
    try:
        # link() fails if dest exists, closing the race between an exists() check and replace().
        os.link(tmp, dest)
    except FileExistsError:
        raise IdentityError(
            f"identity file {dest} already exists; refusing to overwrite it"
        ) from None
    except OSError:
        if dest.exists():
            raise IdentityError(
                f"identity file {dest} already exists; refusing to overwrite it"
            ) from None
        os.replace(tmp, dest)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename durable; some filesystems refuse O_RDONLY fsync on dirs, which is harmless.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
