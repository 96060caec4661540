"""The certified update of a version: the round's merged pseudo-gradient g, encoded (ADR 0029).

A committee merges the round's deltas into g, encodes it with the manifest's update codec
(``SyncRules.update_codec``, dense codecs only), and steps with the decoded ĝ. The encoded g
travels as one delta pack (``compress.wire``: tensors in sorted-name order), and the certificate
names ``update_hash = sha256(UPDATE_DOMAIN + pack)`` beside the state hash. A node holding the
version before downloads the pack, checks its hash, applies the same outer step and checks the
resulting state hash: a few bytes per parameter instead of the whole state and momentum.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from p2pdiloco.choices import UPDATE_CODECS
from p2pdiloco.compress import get_codec
from p2pdiloco.compress.base import Codec, Encoded
from p2pdiloco.compress.wire import MAGIC, MAX_HEADER_BYTES, pack_consuming, unpack_deltas
from p2pdiloco.protocol.reasons import Reason

UPDATE_DOMAIN = b"p2pdiloco/update/v1\x00"
UPDATE_CHUNK_BYTES = 1 << 20  # an update is served in chunks of this many bytes


class UpdateError(Exception):
    """An update that cannot be applied: its bytes, or the state it makes, differ from what the
    certificate names (``code`` says which). Fall back to downloading the whole state."""

    def __init__(self, code: Reason, text: str) -> None:
        super().__init__(text)
        self.code = code


def update_codec(name: str) -> Codec:
    """The codec of ``SyncRules.update_codec``; ValueError for a sparse or unknown one
    (``sync.rules.check_supported`` refuses such a manifest up front)."""
    if name not in UPDATE_CODECS:
        raise ValueError(f"update codec {name!r} is not one of {', '.join(UPDATE_CODECS)}")
    return get_codec(name)


def hash_update(raw: bytes | bytearray) -> str:
    """The update hash a certificate carries: sha256 hex of ``UPDATE_DOMAIN + raw``."""
    h = hashlib.sha256(UPDATE_DOMAIN)
    h.update(raw)  # no copy of a large update
    return h.hexdigest()


def pack_update(update: dict[str, Encoded]) -> bytearray:
    """The canonical bytes of an encoded update (``MergeResult.update``, sorted names). Empties
    ``update`` as it goes: a merge holds the pack, not the pack and its tensors."""
    ordered = {n: update.pop(n) for n in sorted(update)}
    return pack_consuming(ordered)


def max_update_bytes(codec: Codec, shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The most bytes an honest update of ``shapes`` can take: payloads plus the header."""
    payload = sum(codec.wire_bytes(_numel(s)) for s in shapes.values())
    return payload + len(MAGIC) + 4 + MAX_HEADER_BYTES


def decode_update(
    raw: bytes | bytearray, codec_name: str, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """ĝ per tensor from a pack whose hash the caller checked; UpdateError (MALFORMED) if the
    committee certified bytes that do not decode to exactly ``shapes``."""
    codec = update_codec(codec_name)
    expected = {n: tuple(shapes[n]) for n in sorted(shapes)}
    try:
        encoded = unpack_deltas(
            raw, expected=expected, codec=codec_name, max_bytes=max_update_bytes(codec, shapes)
        )
        return {n: codec.decode(enc) for n, enc in encoded.items()}
    except ValueError as e:  # CodecError is one
        raise UpdateError(Reason.MALFORMED, f"certified update does not decode: {e}") from None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
