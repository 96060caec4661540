"""Codecs against naive per-element references, bit-exactness across thread counts, error
feedback, and rejection of malformed payloads from peers."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pdiloco.compress import (
    CODECS,
    BlockwiseCodec,
    Codec,
    CodecError,
    Encoded,
    ErrorFeedback,
    codecs,
    get_codec,
)
from p2pdiloco.errors import ConfigError

# (name, params): defaults plus small blocks, so the reference input spans many blocks.
CONFIGS = [
    ("none", {}),
    ("fp16", {}),
    ("int8", {}),
    ("int8", {"block_size": 16}),
    ("int4", {}),
    ("int4", {"block_size": 16}),
]
IDS = [f"{n}{'-K' + str(p['block_size']) if p else ''}" for n, p in CONFIGS]
QMAX = {"int8": 127, "int4": 7}
F16_MAX = np.float16(65504.0)


def special_input(block: int, qmax: int, seed: int = 0) -> torch.Tensor:
    """Random blocks plus the corner cases: a block of −0.0, exact rounding ties, magnitudes
    whose fp16 scale is subnormal, values beyond the fp16 range, and a partial last block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(300, 7 * block - 5), generator=g) * 1e-3
    blocks = [x[i * block : (i + 1) * block] for i in range(6)]
    blocks[1].fill_(-0.0)
    # absmax = qmax·2⁻⁶ makes the scale exactly 2⁻⁶, so these x/s are .5 ties
    tie = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 3.5, 6.5, -6.5, 0.0, 7.0, -7.0])
    blocks[2].copy_(tie.repeat(block)[:block] * 2**-6)
    blocks[2][0] = qmax * 2**-6
    blocks[3].mul_(1e-4)  # |x| ≲ 4e-7: fp16 subnormals, scale rounds up to 2⁻²⁴ or so
    blocks[4].mul_(1e10)  # |x| ~ 1e7: beyond fp16, the scale clamps to 65504 and codes clip
    blocks[5][: block // 2] = 0.0
    return x


def ref_decode_encode(name: str, block: int, x: torch.Tensor) -> tuple[list[int], list[float]]:
    """Naive per-element loops: returns (codes as ints or fp16 bit patterns, decoded floats)."""
    xs = [np.float32(v) for v in x.tolist()]
    if name == "none":
        return [int(np.float32(v).view(np.uint32)) for v in xs], [float(v) for v in xs]
    if name == "fp16":
        h = [np.float16(min(max(v, -F16_MAX), F16_MAX)) for v in xs]
        return [int(v.view(np.uint16)) for v in h], [float(np.float32(v)) for v in h]
    qmax = QMAX[name]
    codes: list[int] = []
    out: list[float] = []
    for b0 in range(0, len(xs), block):
        blk = xs[b0 : b0 + block]
        blk += [np.float32(0.0)] * (block - len(blk))
        absmax = max(abs(v) for v in blk)
        s32 = min(np.float32(absmax) / np.float32(qmax), np.float32(65504.0))
        s16 = np.float16(s32)
        if np.float32(s16) < s32:
            s16 = np.nextafter(s16, np.float16(np.inf))
        for v in blk:
            c = 0 if s16 == 0 else int(round(float(np.float32(v) / np.float32(s16))))
            c = max(-qmax, min(qmax, c))
            codes.append(c)
            out.append(float(np.float32(c) * np.float32(s16)))
    return codes, out[: len(xs)]


def unpack_codes(name: str, enc: Encoded) -> list[int]:
    if name == "int8":
        return enc.payload["codes"].tolist()
    codes = []
    for byte in enc.payload["codes"].tolist():
        codes += [(byte & 0xF) - 8, (byte >> 4) - 8]
    return codes


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("chunk", [codecs.CHUNK, 48], ids=["one-chunk", "many-chunks"])
def test_matches_naive_reference(
    name: str, params: dict[str, int], chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(codecs, "CHUNK", chunk)
    codec = get_codec(name, **params)
    block = codec.block_size if isinstance(codec, BlockwiseCodec) else 16
    x = special_input(block, QMAX.get(name, 7))
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.dtype == torch.float32 and y.shape == x.shape
    ref_codes, ref_out = ref_decode_encode(name, block, x)
    if name in QMAX:
        ties = unpack_codes(name, enc)[2 * block : 2 * block + 12]
        assert ties[:10] == [QMAX[name], -0, 2, -2, 2, -2, 4, 6, -6, 0][: min(10, block)]
    assert bits(y) == bits(torch.tensor(ref_out, dtype=torch.float32))
    if name in QMAX:
        assert unpack_codes(name, enc) == ref_codes
        s = enc.payload["scales"]
        assert s.numel() == math.ceil(x.numel() / block)
        assert int(s[1].view(torch.int16)) == 0  # the −0.0 block has scale +0
        assert 0 < float(s[3]) < 2**-14 and float(s[4]) == 65504.0  # the cases really occur
        assert max(abs(c) for c in unpack_codes(name, enc)[4 * block : 5 * block]) == QMAX[name]
    else:
        dt = np.uint32 if name == "none" else np.uint16
        assert enc.payload["values"].numpy().view(dt).tolist() == ref_codes


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (5, 7), (2, 3, 65)])
def test_roundtrip_shapes(name: str, params: dict[str, int], shape: tuple[int, ...]) -> None:
    codec = get_codec(name, **params)
    x = torch.randn(shape, dtype=torch.float64)  # cast to fp32 by encode
    enc = codec.encode(x)
    assert enc.shape == shape and enc.codec == name
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in enc.payload.values())
    y = codec.decode(enc)
    assert y.shape == shape and y.dtype == torch.float32
    if name == "none":
        assert torch.equal(y, x.float())


def test_zero_block_decodes_to_exact_zeros() -> None:
    for name in ("int8", "int4"):
        codec = get_codec(name)
        enc = codec.encode(torch.zeros(1000))
        assert not enc.payload["scales"].any()
        assert bits(codec.decode(enc)) == bits(torch.zeros(1000))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_error_at_most_half_a_step(name: str) -> None:
    """|x − x̂| ≤ s/2 + fp32 division rounding (|x/s| ≤ 127.5 ⇒ ≤ 2⁻¹⁷·s); nothing clips."""
    codec = get_codec(name)
    g = torch.Generator().manual_seed(1)
    for scale in (1e-9, 1e-6, 1e-3, 1.0, 1e3):
        x = torch.randn(100_003, generator=g) * scale
        x[::97] *= 50  # outliers
        enc = codec.encode(x)
        assert isinstance(codec, BlockwiseCodec)
        s = enc.payload["scales"].double().repeat_interleave(codec.block_size)[: x.numel()]
        err = (x.double() - codec.decode(enc).double()).abs()
        assert bool((err <= s * (0.5 + 2**-17)).all()), scale


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int4"])
def test_non_finite_delta_is_refused(name: str) -> None:
    codec = get_codec(name)
    for pos in (0, 63, 64, 100_000, 300_000):
        for bad in (math.nan, math.inf, -math.inf):
            x = torch.randn(300_001)
            x[pos] = bad
            with pytest.raises(CodecError):
                codec.encode(x)


def test_fp16_clamps_instead_of_overflowing() -> None:
    codec = get_codec("fp16")
    y = codec.decode(codec.encode(torch.tensor([1e6, -1e6, 65519.0, 1.0])))
    assert y.tolist() == [65504.0, -65504.0, 65504.0, 1.0]


def _hashes(x: torch.Tensor) -> dict[str, str]:
    """sha256 of each codec's payload bytes followed by its decoded bytes."""
    out = {}
    for name in CODECS:
        c = get_codec(name)
        enc = c.encode(x)
        h = hashlib.sha256()
        for k in sorted(enc.payload):
            h.update(enc.payload[k].numpy().tobytes())
        h.update(c.decode(enc).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


_HASH_CHILD = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[2]))
sys.path.insert(0, sys.argv[3])
from test_compress import _hashes
print(json.dumps({"threads": torch.get_num_threads(), **_hashes(torch.load(sys.argv[1]))}))
"""


def test_bit_exact_across_thread_counts(tmp_path: Path) -> None:
    """Payload and decoded bytes agree for 1 and 2 threads (sizes past torch's parallel grain)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2_000_003, generator=g) * 1e-3
    x[::1001] *= 100.0
    path = tmp_path / "x.pt"
    torch.save(x, path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HASH_CHILD, str(path), str(n), str(Path(__file__).parent)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in (1, 2)
    ]
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        results.append(json.loads(stdout))
    assert [r.pop("threads") for r in results] == [1, 2]
    assert results[0] == results[1] == _hashes(x)


def test_error_feedback_removes_the_bias() -> None:
    """One 1.0 per block sets the int4 step to ≈1/7; 0.06 is 0.42 steps and always rounds to 0.

    Without feedback that 0.06 is never sent and the sum drifts by 0.06 a round; with feedback
    the sent sum stays within one step of the true sum (the residual), every round.
    """
    codec = get_codec("int4", block_size=16)
    delta = torch.full((64,), 0.06)
    delta[::16] = 1.0
    step = float(codec.encode(delta).payload["scales"][0])
    ef = ErrorFeedback(codec)
    sent_ef = torch.zeros(64, dtype=torch.float64)
    sent_plain = torch.zeros(64, dtype=torch.float64)
    true = torch.zeros(64, dtype=torch.float64)
    for _ in range(100):
        true += delta.double()
        sent_ef += codec.decode(ef.compress("w", delta)).double()
        sent_plain += codec.decode(codec.encode(delta)).double()
        assert float((true - sent_ef).abs().max()) <= step
    assert float((true - sent_plain).abs().max()) == pytest.approx(6.0, rel=1e-3)
    assert float(ef.residual["w"].abs().max()) <= step


def test_error_feedback_state_roundtrip() -> None:
    codec = get_codec("int4")
    a, b = ErrorFeedback(codec), ErrorFeedback(codec)
    deltas = [torch.randn(3, 100) * 1e-3 for _ in range(3)]
    a.compress("w", deltas[0])
    b.load_state_tensors({**a.state_tensors(), "outer.momentum.w": torch.ones(1)})
    assert set(b.residual) == {"w"}
    for d in deltas[1:]:
        assert codec.decode(a.compress("w", d)).equal(codec.decode(b.compress("w", d)))
    with pytest.raises(ValueError):
        a.compress("w", torch.zeros(4))
    a.reset("w")
    assert a.state_tensors() == {}


def test_ratio_and_nbytes() -> None:
    expected = {"none": 1.0, "fp16": 2.0, "int8": 32 / (8 + 16 / 256), "int4": 32 / (4 + 16 / 64)}
    expected["topk2"] = 32 * 4096 / (64 * (12 + 2) + 16)  # 64 of 4096 kept: offset, 2-bit code
    x = torch.randn(1_000_003)
    for name in CODECS:
        codec = get_codec(name)
        assert codec.ratio() == pytest.approx(expected[name])
        actual = x.numel() * 4 / codec.encode(x).nbytes()
        assert actual == pytest.approx(codec.ratio(), rel=0.01)


def test_get_codec_rejects_bad_config() -> None:
    for name, params in [
        ("zstd", {}),
        ("fp16", {"block_size": 4}),
        ("int4", {"block_size": 7}),
        ("int8", {"block_size": 0}),
        ("int8", {"bits": 3}),
    ]:
        with pytest.raises(ConfigError):
            get_codec(name, **params)


def _malformed(codec: Codec, enc: Encoded) -> list[tuple[str, object]]:
    p = enc.payload
    key = "values" if "values" in p else "codes"
    t = p[key]
    cases: list[tuple[str, object]] = [
        ("not an Encoded", p),
        ("other codec", replace(enc, codec="int2")),
        ("missing key", replace(enc, payload={k: v for k, v in p.items() if k != key})),
        ("extra key", replace(enc, payload={**p, "x": torch.zeros(1, dtype=torch.uint8)})),
        ("payload not a dict", replace(enc, payload=list(p.values()))),
        ("mixed key types", replace(enc, payload={**p, 1: t})),
        ("not a tensor", replace(enc, payload={**p, key: t.tolist()})),
        ("wrong dtype", replace(enc, payload={**p, key: t.to(torch.int16)})),
        ("short", replace(enc, payload={**p, key: t[:-1].clone()})),
        ("long", replace(enc, payload={**p, key: torch.cat([t, t[:1]])})),
        ("2-D", replace(enc, payload={**p, key: t.view(1, -1)})),
        ("huge shape", replace(enc, shape=(2**20, 2**20))),
        ("just over the limit", replace(enc, shape=(2**31 + 1,))),
        ("negative dim", replace(enc, shape=(-1, 300))),
        ("float dim", replace(enc, shape=(300.0,))),
        ("bool dim", replace(enc, shape=(True,))),
        ("string shape", replace(enc, shape="300")),
        ("too many dims", replace(enc, shape=(1,) * 9 + (300,))),
        ("other block count", replace(enc, shape=(600,))),
    ]
    if "scales" in p:
        s = p["scales"]
        for label, v in [
            ("NaN scale", math.nan),
            ("inf scale", math.inf),
            ("negative scale", -1.0),
            ("-0 scale", -0.0),
        ]:
            bad = s.clone()
            bad[0] = v
            cases.append((label, replace(enc, payload={**p, "scales": bad})))
        low = t.clone()
        low[0] = -128 if t.dtype == torch.int8 else 0x80  # code −128 / low nibble 0
        cases.append(("code out of range", replace(enc, payload={**p, "codes": low})))
        if t.dtype == torch.uint8:  # the other code of the byte: high nibble 0
            high = t.clone()
            high[-1] = 0x08
            cases.append(("high code out of range", replace(enc, payload={**p, "codes": high})))
        cases.append(("fp32 scales", replace(enc, payload={**p, "scales": s.float()})))
    else:
        for label, v in [("NaN value", math.nan), ("inf value", math.inf)]:
            bad = t.clone()
            bad[5] = v
            cases.append((label, replace(enc, payload={**p, key: bad})))
    return cases


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
def test_malformed_payloads_raise_codec_error(name: str, params: dict[str, int]) -> None:
    codec = get_codec(name, **params)
    enc = codec.encode(torch.randn(300))
    codec.decode(enc)
    for label, bad in _malformed(codec, enc):
        try:
            codec.decode(bad)  # type: ignore[arg-type]
        except CodecError:
            continue
        pytest.fail(f"{label}: decoded without CodecError")


def _verdict(fn: Callable[[Encoded], object], enc: object) -> str:
    try:
        fn(enc)  # type: ignore[arg-type]
    except CodecError:
        return "refused"
    return "accepted"


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
def test_validate_refuses_exactly_what_decode_refuses(name: str, params: dict[str, int]) -> None:
    """A syncer only validates a payload on arrival and decodes it when merging: the two must
    never disagree, on every malformed case above and on random bytes."""
    codec = get_codec(name, **params)
    enc = codec.encode(torch.randn(300))
    cases: list[tuple[str, object]] = [("honest", enc), *_malformed(codec, enc)]
    rng = np.random.default_rng(5)
    for i in range(200):
        payload = {}
        for k, t in enc.payload.items():
            raw = rng.integers(0, 256, size=t.numel() * t.element_size()).astype(np.uint8)
            payload[k] = torch.from_numpy(raw).view(t.dtype)
        cases.append((f"random bytes {i}", replace(enc, payload=payload)))
    for label, case in cases:
        assert _verdict(codec.validate, case) == _verdict(codec.decode, case), label


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
def test_fuzzed_payloads_raise_only_codec_error(name: str, params: dict[str, int]) -> None:
    """Random dtypes, lengths and bytes: decode either succeeds or raises CodecError."""
    codec = get_codec(name, **params)
    enc = codec.encode(torch.randn(300))
    rng = np.random.default_rng(3)
    dtypes = [torch.uint8, torch.int8, torch.float16, torch.float32, torch.int64, torch.bool]
    for _ in range(300):
        payload = {}
        for k, t in enc.payload.items():
            dt = dtypes[rng.integers(len(dtypes))] if rng.random() < 0.3 else t.dtype
            n = max(0, t.numel() + (int(rng.integers(-3, 4)) if rng.random() < 0.3 else 0))
            raw = rng.integers(0, 256, size=n * torch.empty(0, dtype=dt).element_size())
            payload[k] = torch.from_numpy(raw.astype(np.uint8)).view(dt) if n else t[:0].to(dt)
        shape = (300,) if rng.random() < 0.7 else (int(rng.integers(0, 600)),)
        try:
            y = codec.decode(replace(enc, shape=shape, payload=payload))
        except CodecError:
            continue
        assert y.shape == shape and bool(torch.isfinite(y).all())
