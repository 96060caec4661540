"""The certified global state of a run as an index plus fixed-size, individually hashed chunks.

The state at version v (model parameters and outer-momentum buffers, name → tensor) is laid out
as the raw little-endian bytes of every tensor, in sorted-name order with no padding, and cut
into chunks of ``chunk_bytes`` (the last one shorter). The index is canonical JSON::

    {"chunk_bytes": n, "chunks": [sha256 hex, ...], "format": 1, "total_bytes": n,
     "tensors": [[name, dtype, [shape]], ...], "version": v}

and ``state_hash = sha256(STATE_DOMAIN + index_bytes)`` is all a certificate carries. A peer
fetches the index, checks it against the certified hash (``parse_index``), then fetches chunks
from anyone and checks each on arrival (``verify_chunk``), so a bad chunk costs one re-fetch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2pdiloco.errors import UserError

if sys.byteorder != "little":  # the layout is the host's element bytes
    raise ImportError("p2pdiloco.sync.state needs a little-endian host")

__all__ = [
    "CHUNK_BYTES",
    "STATE_DOMAIN",
    "StateBlob",
    "StateError",
    "StateIndex",
    "decode_state",
    "encode_state",
    "hash_index",
    "parse_index",
    "verify_chunk",
]

CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 256 << 20
MAX_NDIM = 8
MAX_NUMEL = 1 << 40  # bound on the product of a shape's non-zero sizes, so strides fit int64
STATE_DOMAIN = b"p2pdiloco/state-index/v1\x00"
FORMAT = 1
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_INDEX_KEYS = {"format", "version", "chunk_bytes", "total_bytes", "tensors", "chunks"}


class StateError(UserError):
    """A state index or chunk that is malformed or does not match its hash (one-line message).

    From a peer it means corruption or dishonesty: drop what it sent and fetch from another.
    """


@dataclass(frozen=True)
class StateIndex:
    """What ``state_hash`` certifies: the tensor layout and the hash of every chunk."""

    version: int
    chunk_bytes: int  # length of every chunk but the last
    total_bytes: int  # sum of the tensors' byte sizes
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape), sorted by name
    chunk_hashes: tuple[str, ...]  # sha256 hex of each chunk

    def chunk_len(self, i: int) -> int:
        """Byte length of chunk ``i`` (assumed in range)."""
        return min(self.chunk_bytes, self.total_bytes - i * self.chunk_bytes)


@dataclass(frozen=True)
class StateBlob:
    """An encoded state, ready to serve: the index bytes, the chunks and the certified hash."""

    index_bytes: bytes  # canonical JSON of the index
    index: StateIndex
    chunks: tuple[bytes, ...]
    state_hash: str  # sha256 hex of STATE_DOMAIN + index_bytes


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("ascii")


def hash_index(index_bytes: bytes) -> str:
    """The state hash of an index: sha256 hex of ``STATE_DOMAIN + index_bytes``."""
    return hashlib.sha256(STATE_DOMAIN + bytes(index_bytes)).hexdigest()


def encode_state(
    tensors: Mapping[str, torch.Tensor], version: int, chunk_bytes: int = CHUNK_BYTES
) -> StateBlob:
    """Lay out ``tensors`` (any device) as chunks and build the index; deterministic.

    The same tensors (names, dtypes, shapes, bit patterns) and version give the same
    ``index_bytes`` and ``state_hash`` in any process. Raises StateError for a tensor that
    cannot be served (dtype other than float32/float16/bfloat16, non-strided layout, more than
    8 dims), TypeError for a non-str name or non-tensor value, ValueError for a negative
    ``version`` or a ``chunk_bytes`` outside [4096, 256 MiB].
    """
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"state must map str to tensors, got {type(t).__name__} at {name!r}")
        if t.dtype not in _DTYPE_NAMES or t.layout != torch.strided or t.dim() > MAX_NDIM:
            raise StateError(f"state tensor {name!r} ({t.dtype}, {t.layout}) cannot be served")
    layout: list[list[object]] = []
    chunks: list[bytes] = []
    pieces: list[memoryview] = []  # the current chunk, as views into the tensors' bytes
    filled = 0
    for name in sorted(tensors):
        t = tensors[name]
        layout.append([name, _DTYPE_NAMES[t.dtype], list(t.shape)])
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().data
        pos = 0
        while pos < len(data):
            take = min(chunk_bytes - filled, len(data) - pos)
            pieces.append(data[pos : pos + take])
            pos += take
            filled += take
            if filled == chunk_bytes:
                chunks.append(b"".join(pieces))
                pieces, filled = [], 0
    if filled:
        chunks.append(b"".join(pieces))
    index = {
        "format": FORMAT,
        "version": version,
        "chunk_bytes": chunk_bytes,
        "total_bytes": sum(len(c) for c in chunks),
        "tensors": layout,
        "chunks": [hashlib.sha256(c).hexdigest() for c in chunks],
    }
    index_bytes = _canonical(index)
    return StateBlob(index_bytes, _check_index(index), tuple(chunks), hash_index(index_bytes))


def parse_index(index_bytes: bytes, state_hash: str, *, max_bytes: int = 16 << 20) -> StateIndex:
    """Parse an index fetched from a peer, trusting only the certified ``state_hash``.

    Checks, in order: at most ``max_bytes`` long, ``hash_index(index_bytes) == state_hash``,
    canonical JSON of exactly the schema in the module docstring (format 1, dtypes
    float32/float16/bfloat16, names unique and sorted, sizes adding up to ``total_bytes``, one
    hash per chunk, ``chunk_bytes`` in [4096, 256 MiB]). Raises StateError, and nothing else,
    on any violation.
    """
    if not isinstance(index_bytes, bytes | bytearray | memoryview):
        raise StateError(f"state index must be bytes, got {type(index_bytes).__name__}")
    size = memoryview(index_bytes).nbytes
    if size > max_bytes:
        raise StateError(f"state index is {size} bytes, above {max_bytes}")
    index_bytes = bytes(index_bytes)
    if hash_index(index_bytes) != state_hash:
        raise StateError("state index does not match the certified state hash")
    try:
        obj = json.loads(index_bytes)
    except (ValueError, RecursionError):
        raise StateError("state index is not valid JSON") from None
    index = _check_index(obj)
    if _canonical(obj) != index_bytes:
        raise StateError("state index is not canonical JSON")
    return index


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_index(obj: object) -> StateIndex:
    if not isinstance(obj, dict) or set(obj) != _INDEX_KEYS:
        raise StateError(f"state index must be an object with keys {sorted(_INDEX_KEYS)}")
    if obj["format"] != FORMAT or not _is_int(obj["format"]):
        raise StateError(f"state index format must be {FORMAT}")
    version, chunk_bytes, total = obj["version"], obj["chunk_bytes"], obj["total_bytes"]
    if not _is_int(version) or version < 0:
        raise StateError("state index version must be a non-negative int")
    if not _is_int(chunk_bytes) or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise StateError(
            f"state index chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]"
        )
    if not _is_int(total) or total < 0:
        raise StateError("state index total_bytes must be a non-negative int")
    entries = obj["tensors"]
    if not isinstance(entries, list):
        raise StateError("state index tensors must be a list")
    tensors: list[tuple[str, str, tuple[int, ...]]] = []
    nbytes = 0
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise StateError("state index tensor entry must be [name, dtype, shape]")
        name, dtype, shape = entry
        if tensors and name <= tensors[-1][0]:
            raise StateError("state index tensor names must be unique and sorted")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise StateError(f"state index tensor {name[:60]!r} has an unsupported dtype")
        ok = isinstance(shape, list) and len(shape) <= MAX_NDIM
        ok = ok and all(_is_int(s) and s >= 0 for s in shape)
        if not ok or math.prod(max(s, 1) for s in shape) > MAX_NUMEL:
            raise StateError(f"state index tensor {name[:60]!r} has a bad shape")
        tensors.append((name, dtype, tuple(shape)))
        nbytes += math.prod(shape) * DTYPES[dtype].itemsize
    if nbytes != total:
        raise StateError(f"state index total_bytes {total} != {nbytes}, the tensors' sum")
    hashes = obj["chunks"]
    if not isinstance(hashes, list) or len(hashes) != -(-total // chunk_bytes):
        raise StateError("state index must list one hash per chunk")
    if not all(isinstance(h, str) and _HEX64.fullmatch(h) for h in hashes):
        raise StateError("state index chunk hashes must be 64 lowercase hex digits")
    return StateIndex(version, chunk_bytes, total, tuple(tensors), tuple(hashes))


def verify_chunk(index: StateIndex, i: int, data: bytes) -> None:
    """Return if ``data`` is chunk ``i`` of ``index``; raise StateError (one line) otherwise.

    Every chunk is ``index.chunk_bytes`` long but the last, which holds the remainder.
    """
    n = len(index.chunk_hashes)
    if not _is_int(i) or not 0 <= i < n:
        raise StateError(f"state chunk {i!r} is out of range (the state has {n} chunks)")
    try:
        size = memoryview(data).nbytes
    except TypeError:
        raise StateError(f"state chunk {i} must be bytes, got {type(data).__name__}") from None
    if size != index.chunk_len(i):
        raise StateError(f"state chunk {i} is {size} bytes, expected {index.chunk_len(i)}")
    if hashlib.sha256(data).hexdigest() != index.chunk_hashes[i]:
        raise StateError(f"state chunk {i} does not match its hash")


def decode_state(index: StateIndex, chunks: Sequence[bytes]) -> dict[str, torch.Tensor]:
    """Rebuild the state (name → fresh, writable CPU tensor) from all of its chunks.

    Verifies every chunk again; raises StateError for a wrong chunk count or any bad chunk.
    """
    if len(chunks) != len(index.chunk_hashes):
        raise StateError(f"state has {len(index.chunk_hashes)} chunks, got {len(chunks)}")
    for i, data in enumerate(chunks):
        verify_chunk(index, i, data)
    cb = index.chunk_bytes
    out: dict[str, torch.Tensor] = {}
    start = 0  # byte offset of the current tensor in the whole state
    for name, dtype, shape in index.tensors:
        t = torch.empty(shape, dtype=DTYPES[dtype])
        dst = t.reshape(-1).view(torch.uint8).numpy()
        end = start + dst.size
        # Copy chunk by chunk: a tensor may start and end inside chunks and span many.
        for k in range(start // cb, -(-end // cb)):
            lo, hi = max(start, k * cb), min(end, (k + 1) * cb)
            src = np.frombuffer(chunks[k], dtype=np.uint8, count=hi - lo, offset=lo - k * cb)
            dst[lo - start : hi - start] = src
        out[name] = t
        start = end
    return out
