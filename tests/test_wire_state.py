"""Delta packs on the wire and chunked global state: round trips, determinism, and rejection of
every malformed input (hand-made and fuzzed) with only CodecError / StateError."""

from __future__ import annotations

import contextlib
import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2pdiloco.compress import CODECS, CodecError, Encoded, get_codec
from p2pdiloco.compress.wire import MAGIC, pack_deltas, unpack_deltas
from p2pdiloco.sync.state import (
    STATE_DOMAIN,
    StateError,
    decode_state,
    encode_state,
    hash_index,
    parse_index,
    verify_chunk,
)

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"w": (5, 7), "scalar": (), "one": (1,), "empty": (3, 0), "big": (3, 300)}
BIG = 1 << 30


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32)


def _deltas(codec: str, seed: int = 0) -> dict[str, Encoded]:
    g = torch.Generator().manual_seed(seed)
    c = get_codec(codec)
    return {n: c.encode(torch.randn(s, generator=g) * 1e-3) for n, s in SHAPES.items()}


def _craft(header: object, body: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    h = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack(">I", len(h)) + h + body


def _split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack(">I", raw[5:9])[0]
    return json.loads(raw[9 : 9 + n]), raw[9 + n :]


def _canon(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


# ------------------------------------------------------------------------------- delta packs


@pytest.mark.parametrize("codec", CODECS)
def test_pack_round_trip_bit_exact(codec: str) -> None:
    encoded = _deltas(codec)
    raw = pack_deltas(encoded)
    header, _ = _split(raw)
    assert raw[9 : 9 + struct.unpack(">I", raw[5:9])[0]] == _canon(header)
    assert [t["name"] for t in header["tensors"]] == list(SHAPES)
    got = unpack_deltas(raw, expected=SHAPES, codec=codec, max_bytes=len(raw))
    assert list(got) == list(SHAPES)
    c = get_codec(codec)
    for name, enc in encoded.items():
        back = got[name]
        assert back.codec == codec and back.shape == enc.shape
        assert sorted(back.payload) == sorted(enc.payload)
        for key, t in back.payload.items():
            assert t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous()
            assert t.dtype == enc.payload[key].dtype and torch.equal(t, enc.payload[key])
            t.view(torch.uint8).add_(0)  # writable, no warning, own memory
        assert torch.equal(_bits(c.decode(back)), _bits(c.decode(enc)))


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="share a codec"):
        pack_deltas({"a": _deltas("int8")["w"], "b": _deltas("int4")["w"]})
    with pytest.raises(ValueError, match="at least one"):
        pack_deltas({})
    with pytest.raises(ValueError, match="1-D"):
        pack_deltas({"a": Encoded("none", (2, 2), {"values": torch.zeros(2, 2)})})
    with pytest.raises(ValueError, match="1-D"):
        pack_deltas({"a": Encoded("none", (2,), {"values": torch.zeros(2, dtype=torch.int64)})})


def _good() -> tuple[bytes, dict, bytes]:
    raw = pack_deltas(_deltas("int8"))
    header, body = _split(raw)
    return raw, header, body


def _unpack(raw: bytes, expected: dict = SHAPES, codec: str = "int8", max_bytes: int = BIG):
    return unpack_deltas(raw, expected=expected, codec=codec, max_bytes=max_bytes)


def _edit(fn) -> bytes:  # type: ignore[no-untyped-def]
    _, header, body = _good()
    fn(header)
    return _craft(header, body)


def _reorder(h: dict) -> None:
    h["tensors"][0], h["tensors"][1] = h["tensors"][1], h["tensors"][0]


def _dup_key(h: dict) -> None:
    h["tensors"][0]["payload"][1]["key"] = "codes"


MALFORMED = {
    "codec": (_edit(lambda h: h.update(codec="int4")), "codec"),
    "extra header key": (_edit(lambda h: h.update(x=1)), "keys"),
    "tensors not list": (_edit(lambda h: h.update(tensors={})), "tensors"),
    "missing tensor": (_edit(lambda h: h["tensors"].pop()), "tensors"),
    "extra tensor": (_edit(lambda h: h["tensors"].append(h["tensors"][0])), "tensors"),
    "renamed": (_edit(lambda h: h["tensors"][0].update(name="v")), "expected"),
    "order": (_edit(_reorder), "expected"),
    "shape": (_edit(lambda h: h["tensors"][0].update(shape=[7, 5])), "shape"),
    "shape bool": (_edit(lambda h: h["tensors"][2].update(shape=[True])), "shape"),
    "shape str": (_edit(lambda h: h["tensors"][0].update(shape="57")), "shape"),
    "entry key": (_edit(lambda h: h["tensors"][0].update(extra=0)), "keys"),
    "payload key": (_edit(lambda h: h["tensors"][0]["payload"][0].update(x=0)), "keys"),
    "payload not list": (_edit(lambda h: h["tensors"][0].update(payload={})), "list"),
    "dup payload key": (_edit(_dup_key), "sorted"),
    "dtype": (_edit(lambda h: h["tensors"][0]["payload"][0].update(dtype="float64")), "dtype"),
    "numel neg": (_edit(lambda h: h["tensors"][0]["payload"][0].update(numel=-1)), "numel"),
    "numel bool": (_edit(lambda h: h["tensors"][1]["payload"][1].update(numel=True)), "numel"),
    "numel huge": (_edit(lambda h: h["tensors"][0]["payload"][0].update(numel=2**40)), "numel"),
    "numel float": (_edit(lambda h: h["tensors"][0]["payload"][0].update(numel=256.0)), "numel"),
    "bad json": (_craft(None, raw_header=b'{"codec":'), "JSON"),
    "not utf8": (_craft(None, raw_header=b"\xff\xfe"), "JSON"),
    "deep json": (_craft(None, raw_header=b"[" * 100_000), "JSON"),
    "not canonical": (_craft(None, raw_header=b" " + _canon(_good()[1]) + b" "), "canonical"),
    "magic": (b"P2DD\x02" + _good()[0][5:], "magic"),
    "short": (MAGIC + b"\x00", "magic"),
    "header length": (MAGIC + struct.pack(">I", 1 << 21) + b"{}", "header length"),
    "header past end": (MAGIC + struct.pack(">I", 10) + b"{}", "header length"),
    "truncated": (_good()[0][:-1], "payload bytes"),
    "trailing": (_good()[0] + b"\x00", "payload bytes"),
    "no payload": (_craft(_good()[1]), "payload bytes"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_unpack_rejects_malformed(case: str) -> None:
    raw, match = MALFORMED[case]
    with pytest.raises(CodecError, match=match):
        _unpack(raw)


def test_unpack_rejects_wrong_expectations() -> None:
    raw = _good()[0]
    with pytest.raises(CodecError, match="codec"):
        _unpack(raw, codec="int4")
    with pytest.raises(CodecError, match="expected"):
        _unpack(raw, expected=dict(reversed(list(SHAPES.items()))))
    with pytest.raises(CodecError, match="shape"):
        _unpack(raw, expected={**SHAPES, "w": (35,)})
    with pytest.raises(CodecError, match="tensors"):
        _unpack(raw, expected={**SHAPES, "more": (2,)})
    with pytest.raises(CodecError, match="limit"):
        _unpack(raw, max_bytes=len(raw) - 1)
    with pytest.raises(CodecError, match="limit"):  # size is checked before the magic
        _unpack(b"junk" * 100, max_bytes=399)
    with pytest.raises(CodecError, match="bytes"):
        _unpack("not bytes")  # type: ignore[arg-type]
    assert _unpack(bytearray(raw)).keys() == SHAPES.keys()  # type: ignore[arg-type]


def test_unpack_fuzz() -> None:
    """Flips, truncations, insertions and splices of valid packs: CodecError or a clean parse,
    whose decode then gives CodecError or a tensor of the right shape."""
    rng = random.Random(1234)
    for codec in CODECS:
        raw = pack_deltas(_deltas(codec, seed=1))
        c = get_codec(codec)
        for _ in range(300):
            b = bytearray(raw)
            op = rng.randrange(4)
            if op == 0:
                for _ in range(rng.randint(1, 4)):
                    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            elif op == 1:
                del b[rng.randrange(len(b)) :]
            elif op == 2:
                b[rng.randrange(len(b)) : rng.randrange(len(b))] = rng.randbytes(rng.randint(1, 8))
            else:
                pos = rng.randrange(9, 9 + 200)  # inside the header: the dangerous part
                b[pos] = rng.randrange(256)
            try:
                got = _unpack(bytes(b), codec=codec)
            except CodecError:
                continue
            for name, enc in got.items():
                with contextlib.suppress(CodecError):
                    assert c.decode(enc).shape == SHAPES[name]


def test_unpack_header_value_fuzz() -> None:
    """Each header leaf replaced by a value of another JSON type or range: only CodecError."""
    _, header, body = _good()
    odd = [None, True, -1, 0, 2**64, 1e308, 0.5, "", "x" * 300, [], {}, [1], {"a": 1}]

    def leaves(obj: object, path: tuple = ()) -> list[tuple]:
        if isinstance(obj, dict | list):
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            return [path] + [p for k, v in items for p in leaves(v, (*path, k))]
        return [path]

    for path in leaves(header)[1:]:
        for value in odd:
            h = json.loads(json.dumps(header))
            node = h
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = value
            with contextlib.suppress(CodecError):
                got = _unpack(_craft(h, body, raw_header=_canon(h)))
                assert list(got) == list(SHAPES)  # a harmless edit, e.g. numel 0 -> 0


# ------------------------------------------------------------------------------ global state


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Values from integers / 2^k only, so the same bits come out in any process."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.randint(-999, 999, shape, generator=g).float() / 64).to(dtype)

    return {
        "z.weight": r(33, 65),
        "a.bias": r(7, dtype=torch.float16),  # odd byte count: later tensors start unaligned
        "m.bf": r(1001, dtype=torch.bfloat16),
        "outer.mom.w": r(65, 33).t(),  # non-contiguous input
        "scalar": torch.tensor(-0.0),
        "empty": torch.zeros(0, 4),
    }


def test_state_round_trip() -> None:
    state = _state()
    blob = encode_state(state, version=7, chunk_bytes=4096)
    idx = blob.index
    assert idx.version == 7 and idx.chunk_bytes == 4096
    assert [n for n, _, _ in idx.tensors] == sorted(state)
    assert idx.total_bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert len(blob.chunks) == -(-idx.total_bytes // 4096) > 2
    assert all(len(c) == 4096 for c in blob.chunks[:-1]) and 0 < len(blob.chunks[-1]) <= 4096
    assert blob.state_hash == hash_index(blob.index_bytes)
    assert parse_index(blob.index_bytes, blob.state_hash) == idx
    doc = json.loads(blob.index_bytes)
    assert blob.index_bytes == _canon(doc) and doc["format"] == 1
    assert doc["tensors"][0] == ["a.bias", "float16", [7]]
    for i, c in enumerate(blob.chunks):
        verify_chunk(idx, i, c)
    out = decode_state(idx, list(blob.chunks))
    assert list(out) == sorted(state)
    for name, t in state.items():
        o = out[name]
        assert o.dtype == t.dtype and o.shape == t.shape and o.device.type == "cpu"
        assert torch.equal(
            o.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)
        )
    assert torch.signbit(out["scalar"])
    out["z.weight"].add_(1)  # fresh writable memory, independent of the state and the chunks
    assert not torch.equal(out["z.weight"], state["z.weight"])
    assert decode_state(idx, blob.chunks)["z.weight"].equal(state["z.weight"])


def test_state_exact_chunks_and_empty() -> None:
    blob = encode_state({"x": torch.zeros(2048)}, version=0, chunk_bytes=4096)
    assert [len(c) for c in blob.chunks] == [4096, 4096]
    empty = encode_state({}, version=3)
    assert empty.chunks == () and empty.index.total_bytes == 0
    assert decode_state(parse_index(empty.index_bytes, empty.state_hash), []) == {}
    zero = encode_state({"e": torch.zeros(0)}, version=1)
    assert decode_state(zero.index, ())["e"].shape == (0,)


def test_state_deterministic() -> None:
    a = encode_state(_state(), version=5, chunk_bytes=4096)
    shuffled = dict(reversed(list(_state().items())))
    b = encode_state(shuffled, version=5, chunk_bytes=4096)
    assert a.index_bytes == b.index_bytes and a.state_hash == b.state_hash
    assert encode_state(_state(), version=6, chunk_bytes=4096).state_hash != a.state_hash
    assert encode_state(_state(), version=5).state_hash != a.state_hash
    assert encode_state(_state(seed=1), version=5, chunk_bytes=4096).state_hash != a.state_hash


_SUBPROCESS_HASH = """
import sys, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
from tests.test_wire_state import _state
from p2pdiloco.sync.state import encode_state
print(encode_state(_state(), version=5, chunk_bytes=4096).state_hash)
"""


def test_state_hash_same_in_another_process() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_HASH, str(REPO)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == encode_state(_state(), version=5, chunk_bytes=4096).state_hash


def test_encode_state_rejects() -> None:
    with pytest.raises(StateError, match="cannot be served"):
        encode_state({"n": torch.zeros(2, dtype=torch.int64)}, version=0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        encode_state({}, version=0, chunk_bytes=100)
    with pytest.raises(ValueError, match="version"):
        encode_state({}, version=-1)
    with pytest.raises(TypeError):
        encode_state({"a": [1.0]}, version=0)  # type: ignore[dict-item]


def _tampered(edit) -> tuple[bytes, str]:  # type: ignore[no-untyped-def]
    doc = json.loads(encode_state(_state(), version=2, chunk_bytes=4096).index_bytes)
    edit(doc)
    b = _canon(doc)
    return b, hash_index(b)


def _raw(b: bytes) -> tuple[bytes, str]:
    return b, hash_index(b)


BAD_INDEX = {
    "format": (_tampered(lambda d: d.update(format=2)), "format"),
    "format bool": (_tampered(lambda d: d.update(format=True)), "format"),
    "extra key": (_tampered(lambda d: d.update(x=0)), "keys"),
    "missing key": (_tampered(lambda d: d.pop("chunks")), "keys"),
    "version": (_tampered(lambda d: d.update(version=-1)), "version"),
    "version float": (_tampered(lambda d: d.update(version=2.0)), "version"),
    "chunk_bytes small": (_tampered(lambda d: d.update(chunk_bytes=1024)), "chunk_bytes"),
    "chunk_bytes huge": (_tampered(lambda d: d.update(chunk_bytes=1 << 29)), "chunk_bytes"),
    "total": (_tampered(lambda d: d.update(total_bytes=d["total_bytes"] + 1)), "total_bytes"),
    "dtype": (_tampered(lambda d: d["tensors"][0].__setitem__(1, "int64")), "dtype"),
    "shape": (_tampered(lambda d: d["tensors"][0].__setitem__(2, [-7])), "shape"),
    "shape huge": (_tampered(lambda d: d["tensors"][1].__setitem__(2, [0, 2**62, 2**62])), "shape"),
    "entry": (_tampered(lambda d: d["tensors"][0].append(1)), "entry"),
    "unsorted": (_tampered(lambda d: d["tensors"].reverse()), "sorted"),
    "duplicate": (_tampered(lambda d: d["tensors"].insert(0, d["tensors"][0])), "unique"),
    "hash count": (_tampered(lambda d: d["chunks"].pop()), "one hash per chunk"),
    "hash hex": (_tampered(lambda d: d["chunks"].__setitem__(0, "A" * 64)), "hex"),
    "not canonical": (_raw(b" " + encode_state({}, version=0).index_bytes), "canonical"),
    "bad json": (_raw(b'{"format":'), "JSON"),
    "deep json": (_raw(b"[" * 100_000), "JSON"),
    "not object": (_raw(b"[]"), "keys"),
}


@pytest.mark.parametrize("case", sorted(BAD_INDEX))
def test_parse_index_rejects(case: str) -> None:
    (b, h), match = BAD_INDEX[case]
    with pytest.raises(StateError, match=match):
        parse_index(b, h)


def test_index_hash_and_size_checked_first() -> None:
    blob = encode_state(_state(), version=2, chunk_bytes=4096)
    with pytest.raises(StateError, match="above"):
        parse_index(blob.index_bytes, blob.state_hash, max_bytes=len(blob.index_bytes) - 1)
    with pytest.raises(StateError, match="certified"):
        parse_index(blob.index_bytes, "0" * 64)
    with pytest.raises(StateError, match="certified"):
        parse_index(blob.index_bytes.replace(b'"version":2', b'"version":3'), blob.state_hash)
    assert hash_index(b"x") == __import__("hashlib").sha256(STATE_DOMAIN + b"x").hexdigest()


def test_bad_chunks_rejected() -> None:
    blob = encode_state(_state(), version=2, chunk_bytes=4096)
    idx, chunks = blob.index, list(blob.chunks)
    n = len(chunks)
    for i, bad in [(-1, chunks[0]), (n, chunks[0]), (True, chunks[1]), ("0", chunks[0])]:
        with pytest.raises(StateError, match="out of range"):
            verify_chunk(idx, i, bad)  # type: ignore[arg-type]
    flipped = bytearray(chunks[1])
    flipped[100] ^= 1
    cases = [
        (1, bytes(flipped), "hash"),
        (1, chunks[1][:-1], "bytes"),
        (0, chunks[1], "hash"),
        (n - 1, chunks[0], "bytes"),
        (n - 1, chunks[-1] + b"\0", "bytes"),
        (0, 5, "bytes"),
    ]
    for i, data, match in cases:
        with pytest.raises(StateError, match=match):
            verify_chunk(idx, i, data)  # type: ignore[arg-type]
    with pytest.raises(StateError, match="chunks"):
        decode_state(idx, chunks[:-1])
    with pytest.raises(StateError, match="hash"):
        decode_state(idx, [chunks[1], chunks[0], *chunks[2:]])
    with pytest.raises(StateError, match="hash"):
        decode_state(idx, [*chunks[:1], bytes(flipped), *chunks[2:]])


def test_state_fuzz() -> None:
    """Index byte flips: StateError without a matching hash; with the attacker's own hash, a
    StateError or an index whose decode with the honest chunks is a StateError or a state."""
    blob = encode_state(_state(), version=2, chunk_bytes=4096)
    rng = random.Random(99)
    for _ in range(300):
        b = bytearray(blob.index_bytes)
        if rng.random() < 0.3:
            del b[rng.randrange(len(b)) :]
        else:
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.choice(b'0123456789[]{},":-. abcdef' + b"\xff")
        if b == blob.index_bytes:
            continue
        with pytest.raises(StateError):
            parse_index(bytes(b), blob.state_hash)
        try:
            idx = parse_index(bytes(b), hash_index(bytes(b)))
        except StateError:
            continue
        with contextlib.suppress(StateError):
            decode_state(idx, blob.chunks)
