"""The chunked top-k codec (``topk2``): what it keeps, its exact size, bit-exact decode, error
feedback over rounds, and every malformed payload refused with a CodecError."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2pdiloco.compress import CodecError, Encoded, ErrorFeedback, get_codec
from p2pdiloco.compress.sparse import TopKCodec
from p2pdiloco.compress.wire import pack_deltas, unpack_deltas
from p2pdiloco.errors import ConfigError

CODEC = get_codec("topk2")
SHAPES = [(4096,), (3, 4096), (64,), (1,), (0,), (5000,), (7, 333), (2, 4096 + 17)]


def _delta(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 1e-3


@pytest.mark.parametrize("shape", SHAPES)
def test_keeps_the_largest_entries_of_each_chunk_at_the_stated_size(shape: tuple) -> None:
    x = _delta(shape)
    enc = CODEC.encode(x)
    assert enc.nbytes() == CODEC.wire_bytes(x.numel())
    y = CODEC.decode(enc)
    assert y.shape == x.shape and y.dtype == torch.float32
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    for start in range(0, flat_x.numel(), 4096):
        cx, cy = flat_x[start : start + 4096], flat_y[start : start + 4096]
        kept = cy != 0
        assert int(kept.sum()) == CODEC.kept(len(cx))
        # Every kept entry is at least as large as every dropped one, and keeps its sign.
        if bool(kept.any()) and bool((~kept).any()):
            assert float(cx[kept].abs().min()) >= float(cx[~kept].abs().max())
        assert bool((torch.sign(cy[kept]) == torch.sign(cx[kept])).all())
        # Values sit on the chunk's 4-level grid: ±s, ±3s with 3s ≥ max |x|.
        if bool(kept.any()):
            s = float(cy[kept].abs().min())
            assert set(torch.unique(cy[kept].abs()).tolist()) <= {s, 3 * s}
            assert 3 * float(cy[kept].abs().max()) / 3 >= float(cx.abs().max()) - 1e-12


def test_density_and_ratio() -> None:
    x = _delta((64, 4096))
    enc = CODEC.encode(x)
    density = float((CODEC.decode(enc) != 0).float().mean())
    assert density == pytest.approx(64 / 4096)
    ratio = x.numel() * 4 / enc.nbytes()
    assert ratio == pytest.approx(CODEC.ratio(), rel=1e-3)
    assert 140 < ratio < 150


def test_decode_is_bit_exact_and_survives_the_wire() -> None:
    x = {"a": _delta((3, 4096)), "b": _delta((77,), 1)}
    enc = {n: CODEC.encode(t) for n, t in x.items()}
    back = unpack_deltas(
        pack_deltas(enc),
        expected={n: tuple(t.shape) for n, t in x.items()},
        codec="topk2",
        max_bytes=1 << 20,
    )
    for n in x:
        a, b = CODEC.decode(enc[n]), CODEC.decode(back[n])
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_zero_and_tiny_tensors() -> None:
    for shape in [(4096,), (10,)]:
        assert torch.equal(CODEC.decode(CODEC.encode(torch.zeros(shape))), torch.zeros(shape))
    assert CODEC.decode(CODEC.encode(torch.tensor([0.5]))).tolist() == [pytest.approx(0.5, 1e-3)]


def test_error_feedback_sends_everything_over_rounds() -> None:
    """Σ decoded sends = Σ deltas − residual, and the residual stays bounded: a constant delta
    is fully delivered on average."""
    ef = ErrorFeedback(CODEC)
    delta = _delta((2, 4096), 3)
    sent = torch.zeros_like(delta)
    rounds = 640
    for _ in range(rounds):
        sent += CODEC.decode(ef.compress("w", delta))
    residual = ef.residual["w"]
    assert torch.allclose(sent + residual, delta * rounds, rtol=0, atol=1e-5)
    rel = float((sent - delta * rounds).norm() / (delta * rounds).norm())
    assert rel < 0.1


def test_parameters_are_checked() -> None:
    with pytest.raises(ConfigError, match="chunk"):
        TopKCodec(chunk=8192)
    with pytest.raises(ConfigError, match="k must"):
        TopKCodec(chunk=64, k=65)
    with pytest.raises(ConfigError, match="only chunk and k"):
        get_codec("topk2", block_size=4)


def _bad(enc: Encoded, **payload: torch.Tensor) -> Encoded:
    return dataclasses.replace(enc, payload={**enc.payload, **payload})


def _repacked(enc: Encoded, offsets: list[int] | None = None, at: int = 0) -> Encoded:
    """``enc`` with its kept entries' offsets from position ``at`` on replaced by ``offsets``."""
    from p2pdiloco.compress.sparse import _pack12, _unpack12

    n = CODEC.layout(int(torch.tensor(enc.shape).prod()))[2]
    off = _unpack12(enc.payload["index"], n)
    if offsets is not None:
        off[at : at + len(offsets)] = torch.tensor(offsets)
    return _bad(enc, index=_pack12(off))


def test_malformed_payloads_are_refused() -> None:
    enc = CODEC.encode(_delta((2, 4096 + 17)))
    n = CODEC.layout(2 * (4096 + 17))[2]
    assert torch.equal(CODEC.decode(_repacked(enc)), CODEC.decode(enc))  # the helper is faithful
    cases = {
        "increase": _repacked(enc, [5, 5]),  # a duplicate offset
        "increase ": _repacked(enc, [9, 3]),  # unsorted
        "scales must be finite": _bad(
            enc, scales=torch.full_like(enc.payload["scales"], float("nan"))
        ),
        "non-negative": _bad(enc, scales=-enc.payload["scales"]),
        "1-D with": _bad(enc, codes=enc.payload["codes"][:-1]),  # wrong density: too few codes
        "1-D with ": _bad(enc, index=torch.cat([enc.payload["index"], enc.payload["index"][:3]])),
        "CPU torch.uint8": _bad(enc, codes=enc.payload["codes"].to(torch.int8)),
        "keys": dataclasses.replace(enc, payload={"codes": enc.payload["codes"]}),
        "not 'topk2'": dataclasses.replace(enc, codec="int8"),
    }
    for match, bad in cases.items():
        with pytest.raises(CodecError, match=match.strip()):
            CODEC.decode(bad)
    # Unused trailing bits must be zero (n kept entries: 12·n and 2·n bits are not whole bytes).
    odd = CODEC.encode(_delta((4096 + 17,)))
    n_odd = CODEC.layout(4096 + 17)[2]
    assert n_odd % 2 and n_odd % 4
    idx, codes = odd.payload["index"].clone(), odd.payload["codes"].clone()
    idx[-1] |= 0xF0
    codes[-1] |= 0xC0
    with pytest.raises(CodecError, match="offset padding"):
        CODEC.decode(_bad(odd, index=idx))
    with pytest.raises(CodecError, match="code padding"):
        CODEC.decode(_bad(odd, codes=codes))
    assert n > 0


def test_an_offset_past_a_short_last_chunk_is_refused() -> None:
    """12 bits hold every offset of a full 4096-element chunk; the last chunk may be shorter."""
    enc = CODEC.encode(_delta((4096 + 17,)))
    kf = CODEC.kept(4096)
    with pytest.raises(CodecError, match="offset outside"):
        CODEC.decode(_repacked(enc, [17], at=kf))


def test_nan_is_refused_at_encode() -> None:
    x = _delta((4096,))
    x[7] = float("nan")
    with pytest.raises(CodecError, match="NaN"):
        CODEC.encode(x)
