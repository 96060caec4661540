"""A syncer's intake: everything about a submission that does not depend on the round.

Before the payload is read, ``screen`` verifies the signed header and fixes the payload's exact
size (at most ``max_payload``, from the run's codec). Then, checked in this order, cheapest first, each failure a ``Reason`` code and one line of text:
payload present, a certified state held, base version not newer than it (retry later), not a
replay, the run's codec and fragment layout, payload bytes matching the signed digest, and
the payload holding exactly the model's shapes in codes that decode (checked in a worker thread;
decoded only when the round merges it).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from p2pdiloco.compress import CodecError, Encoded, get_codec
from p2pdiloco.compress.wire import MAGIC, unpack_deltas
from p2pdiloco.core.bounded import ReplayGuard
from p2pdiloco.core.round_types import held_cap
from p2pdiloco.net.sync_rpc import RpcRefused
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.protocol.submissions import ParsedSubmission, open_submission, payload_digest
from p2pdiloco.sync.fragments import fragment_plan, round_fragment, round_shapes

Refusal = tuple[Reason, str]
Reject = Callable[[str, str | None, Reason, str], None]  # (peer, digest, code, text): log it


class Intake:
    def __init__(
        self,
        manifest: RunManifest,
        shapes: Mapping[str, tuple[int, ...]],
        run_id: str = "",
        reject: Reject | None = None,
    ) -> None:
        self.manifest = manifest
        self.run_id = run_id
        self.reject: Reject = reject or (lambda peer, digest, code, text: None)
        self.shapes = dict(sorted(shapes.items()))
        self.codec = get_codec(manifest.compression)
        self.fragments = manifest.outer.fragments  # P: the round on v syncs fragment v mod P
        # Largest payload a submission of each fragment may carry: the run's codec over every
        # tensor of the fragment, plus the pack's JSON header (under 512 bytes + the name per
        # tensor). A stream announcing more is refused before its payload is read.
        self.fragment_max = [
            self._max_payload({n: self.shapes[n] for n in names})
            for names in fragment_plan(self.shapes, self.fragments)
        ]
        self.max_payload = max(self.fragment_max)

    @property
    def max_inputs(self) -> int:
        """Inputs this member holds a round at most (local: ``round_types.held_cap``)."""
        return held_cap(self.max_payload)

    def _max_payload(self, shapes: Mapping[str, tuple[int, ...]]) -> int:
        codes = sum(self.codec.wire_bytes(max(1, math.prod(s))) for s in shapes.values())
        header = 4096 + sum(512 + len(n) for n in shapes)
        return len(MAGIC) + 4 + header + codes

    def screen(self, op: str, peer: str, first: bytes) -> int | None:
        """Before a submission's payload is read (``sync_rpc.Screen``): its signed header must
        verify and announce at most ``max_payload`` bytes, which is then the exact size the
        payload frame must have. Raises RpcRefused, after ``self.reject`` logs it against the
        signer (or the stream's peer when the signature fails)."""
        got = self.screen_header(op, peer, first)
        return None if got is None else got[0]

    def screen_header(self, op: str, peer: str, first: bytes) -> tuple[int, str] | None:
        """:meth:`screen`, with the header's signer: (payload bytes, signer)."""
        if op != "submit":
            return None
        try:
            sub = open_submission(first, run_id=self.run_id)
        except InvalidRecord as e:
            self.reject(e.signer or peer, None, Reason.INVALID_SIGNATURE, str(e))
            raise RpcRefused(Reason.INVALID_SIGNATURE, f"invalid submission: {e}") from None
        nbytes = sum(f.nbytes for f in sub.header.fragments)
        index = sub.header.fragments[0].index
        limit = self.fragment_max[index] if index < len(self.fragment_max) else self.max_payload
        if nbytes > limit:
            text = f"payload of {nbytes} bytes is over the run's limit of {limit}"
            self.reject(sub.envelope.signer, sub.digest, Reason.MALFORMED, text)
            raise RpcRefused(Reason.MALFORMED, text)
        return nbytes, sub.envelope.signer

    def decode(self, payload: bytes, base_version: int) -> dict[str, torch.Tensor]:
        """The delta per tensor of the fragment the round on ``base_version`` syncs; CodecError
        if the payload is malformed in any way."""
        return {n: self.codec.decode(e) for n, e in self._unpack(payload, base_version).items()}

    def validate(self, payload: bytes, base_version: int) -> None:
        """CodecError exactly when ``decode`` would raise one, at a fraction of its cost: on
        arrival a payload is only checked; it is decoded when its round merges."""
        for e in self._unpack(payload, base_version).values():
            self.codec.validate(e)

    def _unpack(self, payload: bytes, base_version: int) -> dict[str, Encoded]:
        index = round_fragment(base_version, self.fragments)
        return unpack_deltas(
            payload,
            expected=round_shapes(self.shapes, self.fragments, base_version),
            codec=self.manifest.compression,
            max_bytes=self.fragment_max[index],
        )

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
        want = round_fragment(h.base_version, self.fragments)
        if len(h.fragments) != 1 or h.fragments[0].index != want:
            return (
                Reason.WRONG_FRAGMENT,
                f"a delta on version {h.base_version} carries exactly fragment {want} "
                f"of {self.fragments}",
            )
        frag = h.fragments[0]
        if frag.nbytes != len(payload) or frag.digest != payload_digest(payload):
            return Reason.DIGEST_MISMATCH, "payload does not match the digest in the signed header"
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self.validate, payload, h.base_version
            )
        except CodecError as e:
            return Reason.MALFORMED, f"malformed payload: {e}"
        return None

    async def open_fetched(
        self, digest: str, frames: list[bytes], current_version: int | None, seen: ReplayGuard
    ) -> ParsedSubmission:
        """A submission fetched from a fellow syncer, checked like a learner's own (a replay
        of one seen before is fine: that is how it got into the agreed set); InvalidRecord."""
        if len(frames) != 2:
            raise InvalidRecord(f"a fetched submission has {len(frames)} frames, not 2")
        sub = open_submission(frames[0], run_id=self.run_id)
        if sub.digest != digest:
            raise InvalidRecord("fetched submission has another digest", signer=sub.envelope.signer)
        refusal = await self.check(sub, frames[1], current_version, seen)
        if refusal is not None and refusal[0] is not Reason.REPLAYED:
            raise InvalidRecord(refusal[1], signer=sub.envelope.signer)
        return sub


@dataclass
class Received:
    """An accepted submission as this syncer serves and merges it: parsed, its signed bytes
    and its payload (what a ``SyncerNode`` holds with it, ``core/syncer_node.py``)."""

    sub: ParsedSubmission
    raw: bytes
    payload: bytes
