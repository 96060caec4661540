"""Codec interface for outer deltas, the wire container, and error feedback.

Legend for tensor names: D = flat element count of one tensor, Bk = number of blocks,
K = block size (elements per block), so Bk = ceil(D / K) and the padded length is Bk·K.

A learner encodes each fp32 pseudo-gradient Δ = θ_base − θ_local into an ``Encoded`` (a few
named CPU tensors), ships it, and every syncer decodes it. Decoding is untrusted-input parsing:
it validates everything and raises ``CodecError`` for anything an honest encoder would not have
produced. It is also part of the bit-exact aggregation path, so it only uses element-wise IEEE
operations whose result cannot depend on thread count, vector width or machine.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from p2pdiloco.errors import UserError

MAX_NUMEL = 2**31  # largest tensor a decoder accepts (elements)
MAX_NDIM = 8  # deepest shape a decoder accepts
RESIDUAL_PREFIX = "compress.residual."
FP16_MAX = 65504.0


class CodecError(UserError, ValueError):
    """A delta that cannot be encoded (non-finite values) or a payload that is malformed.

    From a peer it means the sender is buggy or dishonest: drop its delta, do not retry.
    """


@dataclass(frozen=True)
class Encoded:
    """One compressed tensor as it travels: codec name, original shape, named payload tensors.

    ``payload`` tensors are contiguous, 1-D and on the CPU when produced by ``Codec.encode``;
    a decoder re-checks all of that because the object may have been rebuilt from the wire.
    """

    codec: str  # codec name, as in CODECS
    shape: tuple[int, ...]  # shape of the original tensor
    payload: dict[str, torch.Tensor]  # e.g. {"codes": ..., "scales": ...}

    def nbytes(self) -> int:
        """Bytes on the wire: the payload tensors only (name and shape are a few bytes more)."""
        return sum(t.numel() * t.element_size() for t in self.payload.values())


class Codec(ABC):
    """Lossy or lossless coding of one fp32 tensor. Subclasses are stateless after __init__."""

    name: str

    @abstractmethod
    def encode(self, delta: torch.Tensor) -> Encoded:
        """Encode ``delta`` (any shape and device; cast to fp32). Payload tensors are on the CPU.

        Raises CodecError if ``delta`` holds NaN or ±inf (a diverged learner must not send).
        """

    @abstractmethod
    def decode(self, enc: Encoded) -> torch.Tensor:
        """Rebuild an fp32 CPU tensor of ``enc.shape``.

        Raises CodecError (never anything else) for a wrong codec name, shape, payload key,
        dtype or length, or any value an honest encoder cannot produce.
        """

    def validate(self, enc: Encoded) -> None:
        """Raise CodecError exactly when ``decode(enc)`` would, without keeping the result. A
        syncer checks each submission on arrival and decodes it again only when merging, so a
        codec whose checks are cheaper than its decode says so here (``BlockwiseCodec``)."""
        self.decode(enc)

    @abstractmethod
    def ratio(self) -> float:
        """Nominal fp32 bytes / wire bytes for a large tensor (block padding ignored)."""

    def wire_bytes(self, numel: int) -> int:
        """Exact payload bytes of one encoded tensor of ``numel`` elements (receivers size their
        limits from it, before reading a byte). fp32 unless the codec says otherwise."""
        return 4 * numel

    def _check_header(self, enc: object, keys: tuple[str, ...]) -> int:
        """Validate the parts every codec shares; returns D, the element count of ``enc.shape``."""
        if not isinstance(enc, Encoded):
            raise CodecError(f"expected an Encoded, got {type(enc).__name__}")
        if enc.codec != self.name:
            raise CodecError(f"payload is for codec {enc.codec!r}, not {self.name!r}")
        numel = check_shape(enc.shape)
        payload = enc.payload
        if not isinstance(payload, Mapping) or set(payload) != set(keys):
            got = sorted(map(repr, payload)) if isinstance(payload, Mapping) else type(payload)
            raise CodecError(f"{self.name} payload must have keys {sorted(keys)}, got {got}")
        return numel


def check_shape(shape: object) -> int:
    """Element count of a peer-supplied shape; raises CodecError unless it is sane."""
    if not isinstance(shape, tuple | list) or len(shape) > MAX_NDIM:
        got = f"{len(shape)} sizes" if isinstance(shape, tuple | list) else type(shape)
        raise CodecError(f"shape must be a tuple of at most {MAX_NDIM} sizes, got {got}")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise CodecError(f"shape must hold non-negative ints, got {shape!r}")
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise CodecError(f"shape {tuple(shape)} has {numel} elements, above {MAX_NUMEL}")
    return numel


def check_tensor(
    payload: Mapping[str, object], key: str, dtype: torch.dtype, numel: int
) -> torch.Tensor:
    """The payload tensor ``key`` if it is a CPU, 1-D ``dtype`` tensor of ``numel`` elements."""
    t = payload[key]
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"payload {key!r} is a {type(t).__name__}, not a tensor")
    if t.dtype != dtype or t.device.type != "cpu" or t.layout != torch.strided:
        raise CodecError(
            f"payload {key!r} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}"
        )
    if t.dim() != 1 or t.numel() != numel:
        raise CodecError(f"payload {key!r} must be 1-D with {numel} elements, got {tuple(t.shape)}")
    return t.contiguous()


def flat_fp32(delta: torch.Tensor, check_finite: bool = True) -> torch.Tensor:
    """``delta`` as a flat contiguous fp32 tensor (no copy when it already is one).

    Raises CodecError for NaN or ±inf when ``check_finite`` (a caller may check more cheaply).
    """
    x_D = delta.detach().to(torch.float32).reshape(-1).contiguous()
    if check_finite and not all_finite(x_D):
        raise CodecError("delta has NaN or infinite values; refusing to encode it")
    return x_D


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or ±inf in ``x``. min/max propagate NaN, and are ~10× faster than isfinite."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def fp16_round_up(s: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 ≥ each fp32 value of ``s`` (≥ 0), clamped to the fp16 maximum."""
    s = s.clamp(max=FP16_MAX)
    h = s.to(torch.float16)
    low = h.to(torch.float32) < s
    # For non-negative fp16, the next representable value up is the next bit pattern.
    h.view(torch.int16)[low] += 1
    return h


class ErrorFeedback:
    """Per-tensor residuals so that what quantization loses this round is sent next round.

        t ← Δ + e;   send encode(t);   e ← t − decode(encode(t))

    Summed over rounds, what was sent equals the true Δs minus the current residual, so the
    quantization error stays bounded instead of accumulating as a bias. The residual is learner
    state (checkpoint it with ``state_tensors``), not codec state. If a sent delta is dropped
    (rejected as stale, round missed), the learner may ``reset`` to stop carrying stale error.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residual: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def compress(self, name: str, delta: torch.Tensor) -> Encoded:
        """Encode ``delta`` plus the residual kept under ``name`` and store the new residual.

        Raises ValueError if the shape of ``delta`` differs from the stored residual's and
        CodecError if the sum is not finite (the old residual is then kept).
        """
        target = delta.detach().to(torch.float32)
        e = self.residual.get(name)
        if e is not None:
            if e.shape != target.shape:
                raise ValueError(
                    f"delta {name!r} has shape {tuple(target.shape)}, residual {tuple(e.shape)}"
                )
            target = target + e.to(target.device)
        enc = self.codec.encode(target)
        self.residual[name] = target - self.codec.decode(enc).to(target.device)
        return enc

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of ``name`` (all residuals when None)."""
        if name is None:
            self.residual.clear()
        else:
            self.residual.pop(name, None)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Residuals keyed ``compress.residual.<tensor name>``."""
        return {RESIDUAL_PREFIX + n: e for n, e in self.residual.items()}

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore residuals saved by ``state_tensors`` (other keys are ignored)."""
        self.residual = {
            k[len(RESIDUAL_PREFIX) :]: v.float().clone()
            for k, v in tensors.items()
            if k.startswith(RESIDUAL_PREFIX)
        }
