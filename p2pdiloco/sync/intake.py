"""A syncer's intake: everything about a submission that does not depend on the round.

Checked in this order, cheapest first, each failure a ``Reason`` code and one line of text:
payload present, a certified state held, base version not newer than it (retry later), not a
replay, the run's codec and fragment layout, payload bytes matching the signed digest, and
the payload decoding to exactly the model's shapes (in a worker thread).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

import torch

from p2pdiloco.compress import CodecError, get_codec
from p2pdiloco.compress.wire import unpack_deltas
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.submissions import ParsedSubmission, payload_digest
from p2pdiloco.sync.bounded import ReplayGuard

Refusal = tuple[Reason, str]


class Intake:
    def __init__(self, manifest: RunManifest, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.manifest = manifest
        self.shapes = dict(sorted(shapes.items()))
        self.codec = get_codec(manifest.compression)
        numel = sum(max(1, math.prod(s)) for s in self.shapes.values())
        # Largest payload a submission may carry: the fp32 model plus framing headroom.
        self.max_payload = numel * 4 + 4096 * len(self.shapes) + (1 << 20)

    def decode(self, payload: bytes) -> dict[str, torch.Tensor]:
        """The delta per tensor; CodecError if the payload is malformed in any way."""
        enc = unpack_deltas(
            payload,
            expected=self.shapes,
            codec=self.manifest.compression,
            max_bytes=self.max_payload,
        )
        return {n: self.codec.decode(e) for n, e in enc.items()}

    async def check(
        self,
        sub: ParsedSubmission,
        payload: bytes | None,
        current_version: int | None,
        seen: ReplayGuard,
    ) -> Refusal | None:
        """Everything about a submission that does not depend on the round; None if fine."""
        h = sub.header
        if payload is None:
            return Reason.NO_PAYLOAD, "submission without a payload"
        if current_version is None:
            return Reason.NO_STATE, "this node has no certified state yet"
        if h.base_version > current_version:  # not seen yet: the learner will re-send
            return Reason.BASE_TOO_NEW, f"this syncer holds version {current_version}"
        if (sub.digest, h.base_version) in seen:
            return (
                Reason.REPLAYED,
                "replayed submission (this exact signed one was already received)",
            )
        if h.codec != self.manifest.compression:
            return (
                Reason.WRONG_CODEC,
                f"codec {h.codec} is not the run's {self.manifest.compression}",
            )
        if len(h.fragments) != 1 or h.fragments[0].index != 0:
            return Reason.WRONG_FRAGMENT, "expected exactly one fragment (index 0)"
        frag = h.fragments[0]
        if frag.nbytes != len(payload) or frag.digest != payload_digest(payload):
            return Reason.DIGEST_MISMATCH, "payload does not match the digest in the signed header"
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.decode, payload)
        except CodecError as e:
            return Reason.MALFORMED, f"malformed payload: {e}"
        return None
