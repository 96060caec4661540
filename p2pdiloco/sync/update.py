"""The certified update of a version: what a node holding the version before needs to make it.

Two forms (``SyncRules.update_form``). "gradient" (ADR 0029): the round's merged pseudo-gradient
g, encoded with a dense codec; the committee steps with the decoded ĝ and a follower repeats the
outer step with its own momentum and checks the state hash. "params" (ADR 0064): what the
parameters changed by, encoded with any codec (sparse included); the committee keeps what it
did not send as an error-feedback residual beside the momentum (``train.outer.params_step_``),
and a follower adds the decoded update to its parameters and checks the certificate's
``params_hash``, needing neither. Either way the encoded update travels as one delta pack
(``compress.wire``: tensors in sorted-name order), and the certificate names
``update_hash = sha256(UPDATE_DOMAIN + pack)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from p2pdiloco.choices import PARAMS_UPDATE_CODECS, SPARSE_CODECS, UPDATE_CODECS
from p2pdiloco.compress import get_codec
from p2pdiloco.compress.base import Codec, Encoded
from p2pdiloco.compress.sparse import TopKCodec
from p2pdiloco.compress.wire import MAGIC, MAX_HEADER_BYTES, pack_consuming, unpack_deltas
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import SyncRules

UPDATE_DOMAIN = b"p2pdiloco/update/v1\x00"
UPDATE_CHUNK_BYTES = 1 << 20  # an update is served in chunks of this many bytes


class UpdateError(Exception):
    """An update that cannot be applied: its bytes, or the state it makes, differ from what the
    certificate names (``code`` says which). Fall back to downloading the whole state."""

    def __init__(self, code: Reason, text: str) -> None:
        super().__init__(text)
        self.code = code


def update_codec(name: str, form: str = "gradient", k: int | None = None) -> Codec:
    """The codec of ``SyncRules.update_codec`` for an update of ``form`` (``update_form``), with
    ``k`` kept entries per chunk for topk2 (``update_k``; None: the codec's default). A sparse
    codec breaks ties by the lowest offsets, so every syncer encodes the same bytes. ValueError
    for a codec the form cannot certify (``sync.rules.check_supported`` refuses such a manifest
    up front): sparse gradients, or an unknown name."""
    allowed = PARAMS_UPDATE_CODECS if form == "params" else UPDATE_CODECS
    if name not in allowed or form not in ("gradient", "params"):
        raise ValueError(
            f"update codec {name!r} is not one of {', '.join(allowed)} (update form {form!r})"
        )
    if name in SPARSE_CODECS:
        return TopKCodec(name, k=64 if k is None else k, lowest_ties=True)
    return get_codec(name)


def rules_codec(rules: SyncRules) -> Codec:
    """The update codec a run's rules name: ``update_codec`` of their codec, form and k."""
    return update_codec(rules.update_codec, rules.update_form, rules.update_k)


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
    raw: bytes | bytearray, codec: Codec, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The decoded update per tensor from a pack whose hash the caller checked; UpdateError
    (MALFORMED) if the committee certified bytes that do not decode to exactly ``shapes``."""
    expected = {n: tuple(shapes[n]) for n in sorted(shapes)}
    try:
        encoded = unpack_deltas(
            raw, expected=expected, codec=codec.name, max_bytes=max_update_bytes(codec, shapes)
        )
        return {n: codec.decode(enc) for n, enc in encoded.items()}
    except ValueError as e:  # CodecError is one
        raise UpdateError(Reason.MALFORMED, f"certified update does not decode: {e}") from None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
