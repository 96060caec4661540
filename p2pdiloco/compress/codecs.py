"""The codecs: fp32 passthrough, fp16 cast, and blockwise absmax int8 / int4 with fp16 scales.

Legend: D = flat element count, Bk = number of blocks, K = block size, P = Bk·K padded length,
c = blocks in one cache-sized chunk (cK elements); a trailing 2 halves a length: P2 = P/2 bytes
of packed int4 codes, c2 = cK/2 byte pairs of one chunk.

Blockwise quantization of a block b with the fp16 scale s_b:

    s_b  = fp16_round_up(max|x_b| / qmax)      (fp32 division, then up to the next fp16)
    c_i  = clamp(round_half_even(x_i / s_b), −qmax, qmax)
    x̂_i  = c_i · s_b                           (decode; one fp32 multiply)

Rounding the scale *up* (not to nearest) keeps |x_i / s_b| ≤ qmax, so no code is ever clipped
and |x_i − x̂_i| ≤ s_b / 2 (plus fp32 division rounding, < 2⁻¹⁷·s_b); it also gives every
non-zero block a non-zero scale however small its values. A zero block gets s_b = 0, codes 0.
Scales above the fp16 maximum are clamped to 65504 (then codes do clip; only for |x| > 4.5e5).

Decode is bit-exact everywhere: c_i has at most 8 significant bits and s_b at most 11, so the
product fits the 24-bit fp32 significand and the multiply is exact — no rounding at all.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator

import torch

from p2pdiloco import choices
from p2pdiloco.compress.base import (
    FP16_MAX,
    Codec,
    CodecError,
    Encoded,
    all_finite,
    check_tensor,
    flat_fp32,
    fp16_round_up,
)
from p2pdiloco.compress.sparse import TopKCodec
from p2pdiloco.errors import ConfigError

if sys.byteorder != "little":  # int4 (un)packing views byte pairs as little-endian int16
    raise ImportError("p2pdiloco.compress needs a little-endian host")
CHUNK = 2**20  # elements per chunk in the blockwise loops: 4 MiB of fp32, cache-sized


class NoneCodec(Codec):
    """fp32 passthrough (ratio 1): the reference against which lossy codecs are judged."""

    name = "none"

    def encode(self, delta: torch.Tensor) -> Encoded:
        x_D = flat_fp32(delta).cpu()
        return Encoded(self.name, tuple(delta.shape), {"values": x_D.clone()})

    def decode(self, enc: Encoded) -> torch.Tensor:
        numel = self._check_header(enc, ("values",))
        x_D = check_tensor(enc.payload, "values", torch.float32, numel)
        if not all_finite(x_D):
            raise CodecError("none payload has NaN or infinite values")
        return x_D.clone().reshape(enc.shape)

    def ratio(self) -> float:
        return 1.0


class Fp16Codec(Codec):
    """Round-to-nearest fp16 (ratio 2). Values beyond ±65504 are clamped, not sent as inf.

    fp16 keeps 11 significant bits down to 6.1e-5 and subnormals below that (to 6e-8), so for
    deltas much smaller than 1e-4 prefer int8, whose per-block scale follows the magnitude.
    """

    name = "fp16"

    def encode(self, delta: torch.Tensor) -> Encoded:
        x_D = flat_fp32(delta, check_finite=False)
        if x_D.numel():
            lo, hi = (float(v) for v in torch.aminmax(x_D))  # NaN propagates into lo and hi
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise CodecError("delta has NaN or infinite values; refusing to encode it")
            if lo < -FP16_MAX or hi > FP16_MAX:
                x_D = x_D.clamp(-FP16_MAX, FP16_MAX)
        h_D = x_D.to(torch.float16).cpu()
        return Encoded(self.name, tuple(delta.shape), {"values": h_D})

    def decode(self, enc: Encoded) -> torch.Tensor:
        numel = self._check_header(enc, ("values",))
        h_D = check_tensor(enc.payload, "values", torch.float16, numel)
        if not all_finite(h_D):
            raise CodecError("fp16 payload has NaN or infinite values")
        return h_D.to(torch.float32).reshape(enc.shape)

    def ratio(self) -> float:
        return 2.0

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel


class BlockwiseCodec(Codec):
    """Symmetric absmax quantization in blocks of K consecutive elements, fp16 scale per block.

    Payload: ``scales`` (float16, Bk) and ``codes`` (int8, P for 8 bits; uint8, P/2 for 4 bits,
    two codes a byte, low nibble first, each stored as code + 8). The last block is zero-padded.
    Raises ConfigError for an unsupported bit width or a block size below 1 (or odd for 4 bits).
    """

    def __init__(self, name: str, bits: int, block_size: int) -> None:
        if bits not in (4, 8):
            raise ConfigError(f"blockwise codec supports 4 or 8 bits, not {bits}")
        if not isinstance(block_size, int) or block_size < 1 or (bits == 4 and block_size % 2):
            raise ConfigError(
                f"block_size must be a positive int (even for 4 bits), not {block_size!r}"
            )
        self.name = name
        self.bits = bits
        self.block_size = block_size
        self.qmax = 2 ** (bits - 1) - 1  # 127 or 7: symmetric, so −128 / nibble 0 never occur

    def ratio(self) -> float:
        return 32.0 / (self.bits + 16.0 / self.block_size)

    def wire_bytes(self, numel: int) -> int:
        blocks = -(-numel // self.block_size)  # fp16 scale per block, codes zero-padded
        return 2 * blocks + blocks * self.block_size * self.bits // 8

    def _chunks(self, x_D: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(first block index, x_cK) over cache-sized runs of blocks; the partial last block is
        a zero-padded copy. Working chunk by chunk in reused buffers, rather than on whole
        tensors, avoids a fresh D-sized allocation (and its page faults) per operation and keeps
        the intermediates in cache: encode runs 3-4× faster (measured, 16M elements)."""
        K = self.block_size
        n_full = x_D.numel() // K
        rows = max(1, CHUNK // K)
        for b0 in range(0, n_full, rows):
            b1 = min(b0 + rows, n_full)
            yield b0, x_D[b0 * K : b1 * K].view(b1 - b0, K)
        if n_full * K < x_D.numel():
            last = x_D.new_zeros(1, K)
            last[0, : x_D.numel() - n_full * K] = x_D[n_full * K :]
            yield n_full, last

    @torch.no_grad()
    def encode(self, delta: torch.Tensor) -> Encoded:
        x_D = flat_fp32(delta, check_finite=False)  # checked on absmax_Bk below, much cheaper
        K, qmax = self.block_size, self.qmax
        n_blocks = -(-x_D.numel() // K)
        buf = x_D.new_empty(min(n_blocks, max(1, CHUNK // K)) * K)
        absmax_Bk = x_D.new_empty(n_blocks)
        for b0, x_cK in self._chunks(x_D):
            abs_cK = torch.abs(x_cK, out=buf[: x_cK.numel()].view(x_cK.shape))
            torch.amax(abs_cK, dim=1, out=absmax_Bk[b0 : b0 + len(x_cK)])
        if not all_finite(absmax_Bk):
            raise CodecError("delta has NaN or infinite values; refusing to encode it")
        s_Bk = fp16_round_up(absmax_Bk / qmax)
        div_Bk = s_Bk.to(torch.float32)
        div_Bk[s_Bk == 0] = 1.0  # zero blocks: 0 / 1 = 0, no 0 / 0
        if self.bits == 8:
            codes = torch.empty(n_blocks * K, dtype=torch.int8, device=x_D.device)
        else:
            codes = torch.empty(n_blocks * K // 2, dtype=torch.uint8, device=x_D.device)
            c_buf = torch.empty(len(buf), dtype=torch.int8, device=x_D.device)
            pair_buf = torch.empty(len(buf) // 2, dtype=torch.int16, device=x_D.device)
        for b0, x_cK in self._chunks(x_D):
            b1 = b0 + len(x_cK)
            q_cK = torch.div(x_cK, div_Bk[b0:b1, None], out=buf[: x_cK.numel()].view(x_cK.shape))
            q_cK.round_().clamp_(-qmax, qmax)
            if self.bits == 8:
                codes[b0 * K : b1 * K].view(x_cK.shape).copy_(q_cK)
                continue
            # Pack through int16 views of byte pairs (contiguous ops, 4× faster than strided
            # ones): little-endian pair = n0 + 256·n1 with nibbles n = code + 8 in 1..15.
            pair_c2 = c_buf[: x_cK.numel()].copy_(q_cK.view(-1)).add_(8).view(torch.int16)
            byte_c2 = torch.bitwise_right_shift(pair_c2, 4, out=pair_buf[: len(pair_c2)])
            byte_c2.bitwise_or_(pair_c2).bitwise_and_(0xFF)  # n0 + 16·n1
            codes[b0 * K // 2 : b1 * K // 2].copy_(byte_c2)
        payload = {"codes": codes.cpu().contiguous(), "scales": s_Bk.cpu().contiguous()}
        return Encoded(self.name, tuple(delta.shape), payload)

    @torch.no_grad()
    def validate(self, enc: Encoded) -> None:
        """``decode``'s checks alone: the scales, and no code outside the symmetric range
        (int8 −128, or nibble 0 for 4 bits). The decoded product of an in-range code and a
        finite fp16 scale is always finite, so nothing else can fail. A fifth of a decode's
        time (tests/test_compress.py holds the two to the same verdicts)."""
        _, n_blocks, _ = self._scales(enc)
        K = self.block_size
        if self.bits == 8:
            codes_P = check_tensor(enc.payload, "codes", torch.int8, n_blocks * K)
            bad = bool(codes_P.numel()) and int(codes_P.min()) < -self.qmax
        else:
            packed_P2 = check_tensor(enc.payload, "codes", torch.uint8, n_blocks * K // 2)
            low = torch.bitwise_and(packed_P2, 0x0F)
            bad = not bool(low.all()) or not bool(torch.bitwise_right_shift(packed_P2, 4).all())
        if bad:
            raise CodecError(f"{self.name} code {-self.qmax - 1} is outside the symmetric range")

    def _scales(self, enc: Encoded) -> tuple[int, int, torch.Tensor]:
        """(D, blocks, fp16 scales) once the header and the scales check out."""
        numel = self._check_header(enc, ("codes", "scales"))
        n_blocks = -(-numel // self.block_size)
        s_Bk = check_tensor(enc.payload, "scales", torch.float16, n_blocks)
        if not bool((torch.isfinite(s_Bk) & ~torch.signbit(s_Bk)).all()):
            raise CodecError(f"{self.name} scales must be finite and non-negative (not even −0)")
        return numel, n_blocks, s_Bk

    @torch.no_grad()
    def decode(self, enc: Encoded) -> torch.Tensor:
        numel, n_blocks, s_Bk = self._scales(enc)
        K, qmax = self.block_size, self.qmax
        rows = max(1, CHUNK // K)
        if self.bits == 8:
            codes_P = check_tensor(enc.payload, "codes", torch.int8, n_blocks * K)
        else:
            packed_P2 = check_tensor(enc.payload, "codes", torch.uint8, n_blocks * K // 2)
            pair_buf = torch.empty(min(n_blocks, rows) * K // 2, dtype=torch.int16)
            tmp_buf = torch.empty_like(pair_buf)
        s32_Bk = s_Bk.to(torch.float32)
        x_P = torch.empty(n_blocks * K, dtype=torch.float32)
        for b0 in range(0, n_blocks, rows):
            b1 = min(b0 + rows, n_blocks)
            if self.bits == 8:
                c_cK = codes_P[b0 * K : b1 * K].view(b1 - b0, K)
            else:
                n_pairs = (b1 - b0) * K // 2
                pair_c2 = pair_buf[:n_pairs].copy_(packed_P2[b0 * K // 2 : b1 * K // 2])
                high_c2 = torch.bitwise_left_shift(pair_c2, 4, out=tmp_buf[:n_pairs])
                pair_c2.bitwise_or_(high_c2).bitwise_and_(0x0F0F)  # n0 + 256·n1, little-endian
                c_cK = pair_c2.view(torch.int8).sub_(8).view(b1 - b0, K)
            if int(c_cK.min()) < -qmax:
                raise CodecError(f"{self.name} code {-qmax - 1} is outside the symmetric range")
            x_cK = x_P[b0 * K : b1 * K].view(b1 - b0, K)
            x_cK.copy_(c_cK).mul_(s32_Bk[b0:b1, None])
        return x_P[:numel].reshape(enc.shape)


CODECS = choices.CODECS  # the names, kept where the command line reads them without torch


def get_codec(name: str, **params: int) -> Codec:
    """Build a codec by name; ``block_size`` for int8 and int4, ``chunk`` and ``k`` for topk2
    (chunked top-k with 2-bit values, ``compress.sparse``: k = 64 of every 4096, density 1/64).

    Defaults: int4 uses K = 64, int8 uses K = 256. int4 steps are coarse (absmax/7), so a single
    outlier coarsens its whole block: relative error on 4M elements, N(0, 1e-3) / Student-t(3),
    is 9.7 / 14.4 % at K = 32 (ratio 7.11), 10.8 / 18.1 % at K = 64 (7.53), 11.7 / 22.5 % at
    K = 128 (7.76); 64 is the knee. int8 steps are fine (absmax/127): 0.60 / 1.1 % at K = 64
    (3.88), 0.70 / 1.7 % at K = 256 (3.97), so K = 256 keeps the scale overhead under 1 %.
    Raises ConfigError for an unknown name or parameter.
    """
    if name in ("none", "fp16"):
        if params:
            raise ConfigError(f"codec {name!r} takes no parameters, got {sorted(params)}")
        return NoneCodec() if name == "none" else Fp16Codec()
    if name in ("int8", "int4"):
        unknown = set(params) - {"block_size"}
        if unknown:
            raise ConfigError(f"codec {name!r} takes only block_size, got {sorted(unknown)}")
        bits = int(name[3:])
        return BlockwiseCodec(name, bits, params.get("block_size", 256 if bits == 8 else 64))
    if name == "topk2":
        unknown = set(params) - {"chunk", "k"}
        if unknown:
            raise ConfigError(f"codec {name!r} takes only chunk and k, got {sorted(unknown)}")
        return TopKCodec(name, params.get("chunk", 4096), params.get("k", 64))
    raise ConfigError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
