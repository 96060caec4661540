"""Chunked top-k with 2-bit values (SparseLoCo-class): about 1.6 % of a delta's entries, ~145×.

Legend: D = flat element count, C = chunk length (4096), Nc = chunks = ceil(D / C), L = length
of one chunk (C, or less for the last), k(L) = entries kept in it, N = Σ k(L) kept in all.

Per chunk of C consecutive elements (the last may be shorter), keep the k(L) largest |x|:

    k(L) = min(L, max(1, ceil(L · k / C)))          (k = 64 of C = 4096: density 1/64)
    s    = fp16_round_up(max|x_chunk| / 3)          (the chunk's step; 0 for a zero chunk)
    c_i  = clamp(round_half_even((x_i / s + 3) / 2), 0, 3)
    x̂_i  = (2·c_i − 3) · s                          (decode: −3s, −s, s, 3s; one fp32 multiply)

Payload: ``index`` (uint8, ceil(12·N / 8)): each kept entry's offset in its chunk as 12 bits,
two offsets in three bytes (low byte of the first, then its high nibble under the second's low
nibble, then the second's high byte), chunk by chunk, offsets strictly increasing within a
chunk; ``codes`` (uint8, ceil(N / 4)): 2-bit codes, four a byte, lowest bits first; ``scales``
(float16, Nc). Unused trailing bits are zero. Every length follows from the shape, so a
payload of the wrong density is refused by its length alone.

Decode is bit-exact: (2c − 3) has 2 significant bits and s at most 11, so the product is exact
in fp32; the scatter into zeros adds nothing. Which entries an encoder keeps when several tie
is its own business (the decoder checks only that offsets are in range, increasing, unique);
with ``lowest_ties`` it keeps the lowest offsets among the magnitudes equal to the k-th largest,
so every encoder of one tensor writes the same bytes (a certified update's, ADR 0064).

Most of each delta stays behind: the learner's ``ErrorFeedback`` carries it to the next round,
so over rounds what was sent sums to the true deltas minus a bounded residual.
"""

from __future__ import annotations

import torch

from p2pdiloco.compress.base import (
    Codec,
    CodecError,
    Encoded,
    check_tensor,
    flat_fp32,
    fp16_round_up,
)
from p2pdiloco.errors import ConfigError

OFFSET_BITS = 12  # offsets within a chunk: C ≤ 4096


class TopKCodec(Codec):
    """Chunked top-k, 2-bit values with an fp16 step per chunk (module docstring).

    Raises ConfigError for a chunk length outside 2..4096 or k outside 1..chunk.
    """

    def __init__(
        self, name: str = "topk2", chunk: int = 4096, k: int = 64, lowest_ties: bool = False
    ) -> None:
        if not isinstance(chunk, int) or not 2 <= chunk <= 2**OFFSET_BITS:
            raise ConfigError(f"topk chunk must be an int in 2..{2**OFFSET_BITS}, not {chunk!r}")
        if not isinstance(k, int) or not 1 <= k <= chunk:
            raise ConfigError(f"topk k must be an int in 1..{chunk}, not {k!r}")
        self.name, self.chunk, self.k = name, chunk, k
        self.lowest_ties = lowest_ties

    # -- sizes -----------------------------------------------------------------------------------

    def kept(self, length: int) -> int:
        """k(L): entries kept of a chunk of ``length`` elements."""
        if length <= 0:
            return 0
        return min(length, max(1, -(-length * self.k // self.chunk)))

    def layout(self, numel: int) -> tuple[int, int, int]:
        """(Nc chunks, full chunks, N kept entries) of a tensor of ``numel`` elements."""
        full, tail = divmod(numel, self.chunk)
        return full + (tail > 0), full, full * self.kept(self.chunk) + self.kept(tail)

    def wire_bytes(self, numel: int) -> int:
        n_chunks, _, n = self.layout(numel)
        return -(-OFFSET_BITS * n // 8) + -(-n // 4) + 2 * n_chunks

    def ratio(self) -> float:
        return 32.0 * self.chunk / (self.k * (OFFSET_BITS + 2) + 16)

    # -- encode ----------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, delta: torch.Tensor) -> Encoded:
        x_D = flat_fp32(delta).cpu()
        numel = x_D.numel()
        n_chunks, full, n = self.layout(numel)
        if not n_chunks:
            return Encoded(self.name, tuple(delta.shape), _empty_payload())
        C = self.chunk
        offsets, values, absmax = [], [], []
        if full:  # the full chunks as rows, all at once
            x_cC = x_D[: full * C].view(full, C)
            abs_cC = x_cC.abs()
            top = self._top(abs_cC, self.kept(C))
            offsets.append(top.reshape(-1))
            values.append(torch.gather(x_cC, 1, top).reshape(-1))
            absmax.append(abs_cC.amax(dim=1))
        if full < n_chunks:
            tail = x_D[full * C :]
            top = self._top(tail.abs().view(1, -1), self.kept(len(tail))).view(-1)
            offsets.append(top)
            values.append(tail[top])
            absmax.append(tail.abs().amax().view(1))
        s_Nc = fp16_round_up(torch.cat(absmax) / 3)
        step_Nc = s_Nc.to(torch.float32)
        step_Nc[s_Nc == 0] = 1.0  # a zero chunk: its values are 0, and so is their decode
        step_N = step_Nc[self._chunk_of(n, full)]
        c_N = torch.cat(values).div_(step_N).add_(3).div_(2).round_().clamp_(0, 3)
        payload = {
            "index": _pack12(torch.cat(offsets)),
            "codes": _pack2(c_N.to(torch.uint8)),
            "scales": s_Nc.contiguous(),
        }
        return Encoded(self.name, tuple(delta.shape), payload)

    def _top(self, abs_cL: torch.Tensor, k: int) -> torch.Tensor:
        """The offsets of the ``k`` largest of each row, increasing; with ``lowest_ties``, the
        lowest offsets among those equal to the row's k-th largest (one answer, any build)."""
        top = torch.topk(abs_cL, k, dim=1, sorted=False)
        if not self.lowest_ties:
            return top.indices.sort(dim=1).values
        kth_c1 = top.values.amin(dim=1, keepdim=True)
        above_cL = abs_cL > kth_c1
        tied_cL = abs_cL == kth_c1
        room_c1 = k - above_cL.sum(dim=1, keepdim=True)
        keep_cL = above_cL | (tied_cL & (tied_cL.cumsum(dim=1) <= room_c1))
        return keep_cL.nonzero()[:, 1].view(abs_cL.shape[0], k)

    def _chunk_of(self, n: int, full: int) -> torch.Tensor:
        """The chunk index of each of the ``n`` kept entries, in payload order."""
        kf = self.kept(self.chunk)
        i_N = torch.arange(n, dtype=torch.int64)
        return torch.where(i_N < full * kf, i_N // kf, torch.full_like(i_N, full))

    # -- decode ----------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, enc: Encoded) -> torch.Tensor:
        numel = self._check_header(enc, ("codes", "index", "scales"))
        n_chunks, full, n = self.layout(numel)
        C = self.chunk
        s_Nc = check_tensor(enc.payload, "scales", torch.float16, n_chunks)
        if not bool((torch.isfinite(s_Nc) & ~torch.signbit(s_Nc)).all()):
            raise CodecError(f"{self.name} scales must be finite and non-negative (not even −0)")
        packed_idx = check_tensor(enc.payload, "index", torch.uint8, -(-OFFSET_BITS * n // 8))
        packed_codes = check_tensor(enc.payload, "codes", torch.uint8, -(-n // 4))
        off_N = _unpack12(packed_idx, n)
        c_N = _unpack2(packed_codes, n)
        chunk_N = self._chunk_of(n, full)
        length_N = torch.where(chunk_N < full, C, numel - full * C)
        if n and bool((off_N >= length_N).any()):
            raise CodecError(f"{self.name} offset outside its chunk")
        same_chunk = chunk_N[1:] == chunk_N[:-1]
        if n > 1 and bool((same_chunk & (off_N[1:] <= off_N[:-1])).any()):
            raise CodecError(f"{self.name} offsets must increase within a chunk (no duplicates)")
        x_D = torch.zeros(numel, dtype=torch.float32)
        if n:
            step_N = s_Nc.to(torch.float32)[chunk_N]
            vals = (c_N.to(torch.float32) * 2 - 3).mul_(step_N)
            x_D[chunk_N * C + off_N] = vals
        return x_D.reshape(enc.shape)


def _empty_payload() -> dict[str, torch.Tensor]:
    return {
        "index": torch.empty(0, dtype=torch.uint8),
        "codes": torch.empty(0, dtype=torch.uint8),
        "scales": torch.empty(0, dtype=torch.float16),
    }


def _pack12(off_N: torch.Tensor) -> torch.Tensor:
    """12-bit offsets, two in three bytes; an odd count leaves the last high nibble zero."""
    n = off_N.numel()
    pairs = torch.zeros(-(-n // 2) * 2, dtype=torch.int64)
    pairs[:n] = off_N
    a, b = pairs[0::2], pairs[1::2]
    out = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1).reshape(-1)
    return out[: -(-OFFSET_BITS * n // 8)].to(torch.uint8).contiguous()


def _unpack12(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``_pack12``; CodecError if the unused trailing bits are not zero."""
    if n % 2 and int(packed[-1]) >> 4:
        raise CodecError("offset padding bits must be zero")
    raw = torch.zeros(-(-n // 2) * 3, dtype=torch.int64)
    raw[: packed.numel()] = packed
    t = raw.view(-1, 3)
    a = t[:, 0] | ((t[:, 1] & 0xF) << 8)
    b = (t[:, 1] >> 4) | (t[:, 2] << 4)
    return torch.stack([a, b], dim=1).reshape(-1)[:n]


def _pack2(c_N: torch.Tensor) -> torch.Tensor:
    """2-bit codes, four a byte, lowest bits first; trailing bits zero."""
    n = c_N.numel()
    quads = torch.zeros(-(-n // 4) * 4, dtype=torch.uint8)
    quads[:n] = c_N
    q = quads.view(-1, 4)
    return (q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)).contiguous()


def _unpack2(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``_pack2``; CodecError if the unused trailing bits are not zero."""
    if n % 4 and int(packed[-1]) >> (2 * (n % 4)):
        raise CodecError("code padding bits must be zero")
    p = packed.to(torch.int64)
    q = torch.stack([p & 3, (p >> 2) & 3, (p >> 4) & 3, (p >> 6) & 3], dim=1)
    return q.reshape(-1)[:n]
