"""Bytes on the wire for one learner's compressed deltas: a JSON header, then raw payloads.

Layout::

    MAGIC | u32 big-endian header length | header | payload bytes

The header is canonical JSON (sorted keys, no spaces, ASCII) of::

    {"codec": str, "tensors": [{"name": str, "shape": [int, ...],
                                "payload": [{"key": str, "dtype": str, "numel": int}, ...]}, ...]}

with tensors in the sender's order and payload keys sorted. The payload bytes are every payload
tensor's raw little-endian elements, concatenated in header order, with no padding.

``unpack_deltas`` parses bytes from a peer: it checks structure only (sizes, names, shapes,
dtypes, lengths) and raises ``CodecError`` for anything else; values are checked by
``Codec.decode``, which the caller runs on every returned ``Encoded``.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping

import numpy as np
import torch

from p2pdiloco.compress.base import MAX_NUMEL, CodecError, Encoded

if sys.byteorder != "little":  # payload bytes are the host's element bytes
    raise ImportError("p2pdiloco.compress.wire needs a little-endian host")

__all__ = ["DTYPES", "MAGIC", "MAX_HEADER_BYTES", "pack_consuming", "pack_deltas", "unpack_deltas"]

MAGIC = b"P2DD\x01"
MAX_HEADER_BYTES = 1 << 20  # largest JSON header a receiver parses
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_LEN = struct.Struct(">I")


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("ascii")


def pack_deltas(encoded: Mapping[str, Encoded]) -> bytes:
    """Serialize ``encoded`` (tensor name → Encoded), keeping the mapping's order.

    Raises ValueError if the mapping is empty, its Encoded do not all share one codec name, or a
    payload tensor is not a 1-D strided tensor of an allowed dtype (``DTYPES``); TypeError for a
    value that is not an Encoded. Payload tensors on an accelerator are copied to the CPU.
    """
    header, blobs = _pack_parts(encoded)
    return b"".join([header, *blobs])


def pack_consuming(encoded: dict[str, Encoded]) -> bytearray:
    """``pack_deltas(encoded)``, emptying ``encoded`` as it goes: each tensor is removed once
    its payloads are copied, so a caller holding nothing else of them packs in the pack's
    size, not twice it (the certified update of a large model, ADR 0029)."""
    header, blobs = _pack_parts(encoded)
    out = bytearray(header)
    blobs.reverse()
    for name in list(encoded):
        for _ in encoded.pop(name).payload:
            out += blobs.pop()  # grows in place: large buffers are remapped, not copied
    return out


def _pack_parts(encoded: Mapping[str, Encoded]) -> tuple[bytes, list[memoryview]]:
    """Magic, length and header; then every payload's bytes, in order (views, not copies)."""
    if not encoded:
        raise ValueError("pack_deltas needs at least one tensor")
    codecs = {enc.codec if isinstance(enc, Encoded) else None for enc in encoded.values()}
    if None in codecs:
        raise TypeError("pack_deltas takes a mapping of name -> Encoded")
    if len(codecs) != 1:
        raise ValueError(f"all deltas in one pack must share a codec, got {sorted(codecs)}")
    entries: list[dict[str, object]] = []
    blobs: list[memoryview] = []
    for name, enc in encoded.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        payload: list[dict[str, object]] = []
        for key in sorted(enc.payload):
            t = enc.payload[key]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name!r} payload {key!r} is a {type(t).__name__}, not a tensor")
            if t.dtype not in _DTYPE_NAMES or t.dim() != 1 or t.layout != torch.strided:
                raise ValueError(
                    f"{name!r} payload {key!r} must be a 1-D tensor of one of {sorted(DTYPES)}, "
                    f"got {t.dtype} with shape {tuple(t.shape)}"
                )
            flat = t.detach().cpu().contiguous()
            payload.append({"key": key, "dtype": _DTYPE_NAMES[t.dtype], "numel": flat.numel()})
            blobs.append(flat.view(torch.uint8).numpy().data)
        entries.append({"name": name, "shape": [int(s) for s in enc.shape], "payload": payload})
    header = _canonical({"codec": codecs.pop(), "tensors": entries})
    return MAGIC + _LEN.pack(len(header)) + header, blobs


def unpack_deltas(
    raw: bytes | bytearray, *, expected: Mapping[str, tuple[int, ...]], codec: str, max_bytes: int
) -> dict[str, Encoded]:
    """Parse a peer's pack into name → Encoded, in the order of ``expected``.

    ``raw`` is hostile. It must be at most ``max_bytes`` long (checked before anything is
    parsed), carry ``MAGIC`` and a canonical header of exactly the schema above, name ``codec``
    and exactly the tensors of ``expected`` in that order with those shapes, use only ``DTYPES``,
    and end exactly where the payloads do. Any violation raises ``CodecError`` with a one-line
    reason, and nothing else is ever raised. The returned payload tensors are fresh CPU,
    contiguous, 1-D and writable. Values are not checked: run ``get_codec(codec).decode``.
    """
    try:
        mv = memoryview(raw).cast("B")
    except TypeError:
        raise CodecError(f"pack must be bytes, got {type(raw).__name__}") from None
    if mv.nbytes > max_bytes:
        raise CodecError(f"pack is {mv.nbytes} bytes, above the limit of {max_bytes}")
    head = len(MAGIC) + _LEN.size
    if mv.nbytes < head or mv[: len(MAGIC)] != MAGIC:
        raise CodecError("pack does not start with the delta-pack magic")
    (header_len,) = _LEN.unpack(mv[len(MAGIC) : head])
    if header_len > MAX_HEADER_BYTES or header_len > mv.nbytes - head:
        raise CodecError(f"pack header length {header_len} exceeds the limit or the pack")
    header_bytes = bytes(mv[head : head + header_len])
    try:
        header = json.loads(header_bytes)
    except (ValueError, RecursionError):
        raise CodecError("pack header is not valid JSON") from None
    layout = _check_header(header, expected, codec)
    if _canonical(header) != header_bytes:
        raise CodecError("pack header is not canonical JSON")
    offset = head + header_len
    need = sum(
        DTYPES[dtype].itemsize * numel for _, payload in layout for _, dtype, numel in payload
    )
    if need != mv.nbytes - offset:
        raise CodecError(f"pack has {mv.nbytes - offset} payload bytes, header says {need}")
    out: dict[str, Encoded] = {}
    for name, payload in layout:
        tensors: dict[str, torch.Tensor] = {}
        for key, dtype, numel in payload:
            t = torch.empty(numel, dtype=DTYPES[dtype])
            dst = t.view(torch.uint8).numpy()
            dst[:] = np.frombuffer(mv, dtype=np.uint8, count=dst.size, offset=offset)
            offset += dst.size
            tensors[key] = t
        out[name] = Encoded(codec, tuple(expected[name]), tensors)
    return out


_Layout = list[tuple[str, list[tuple[str, str, int]]]]


def _short(x: object) -> str:
    """repr of a peer-supplied value, cut so that error messages stay one short line."""
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_header(header: object, expected: Mapping[str, tuple[int, ...]], codec: str) -> _Layout:
    """(name, [(key, dtype, numel)]) per tensor if ``header`` has exactly the expected schema."""
    if not isinstance(header, dict) or set(header) != {"codec", "tensors"}:
        raise CodecError("pack header must be an object with keys 'codec' and 'tensors'")
    if header["codec"] != codec:
        raise CodecError(f"pack is for codec {_short(header['codec'])}, expected {codec!r}")
    tensors = header["tensors"]
    if not isinstance(tensors, list) or len(tensors) != len(expected):
        got = len(tensors) if isinstance(tensors, list) else type(tensors).__name__
        raise CodecError(f"pack must hold {len(expected)} tensors, got {got}")
    layout: _Layout = []
    for entry, (want_name, want_shape) in zip(tensors, expected.items(), strict=True):
        if not isinstance(entry, dict) or set(entry) != {"name", "shape", "payload"}:
            raise CodecError("pack tensor entry must have keys 'name', 'shape' and 'payload'")
        name, shape, payload = entry["name"], entry["shape"], entry["payload"]
        if name != want_name:
            raise CodecError(f"pack tensor {_short(name)} where {want_name!r} was expected")
        ok = isinstance(shape, list) and all(_is_int(s) for s in shape)
        if not ok or tuple(shape) != tuple(want_shape):
            raise CodecError(
                f"pack tensor {name!r} has shape {_short(shape)}, expected {list(want_shape)}"
            )
        if not isinstance(payload, list):
            raise CodecError(f"pack tensor {name!r} payload must be a list")
        items: list[tuple[str, str, int]] = []
        for p in payload:
            if not isinstance(p, dict) or set(p) != {"key", "dtype", "numel"}:
                raise CodecError(f"pack tensor {name!r} payload entry has the wrong keys")
            key, dtype, numel = p["key"], p["dtype"], p["numel"]
            if not isinstance(key, str) or (items and key <= items[-1][0]):
                raise CodecError(f"pack tensor {name!r} payload keys must be sorted unique str")
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise CodecError(
                    f"pack tensor {name!r} payload {_short(key)} has dtype {_short(dtype)}"
                )
            if not _is_int(numel) or not 0 <= numel <= MAX_NUMEL:
                raise CodecError(
                    f"pack tensor {name!r} payload {_short(key)} has numel {_short(numel)}"
                )
            items.append((key, dtype, numel))
        layout.append((name, items))
    return layout
