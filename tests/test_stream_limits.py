"""Inbound stream caps, the header-first screen and the codec-sized payload limit (no network)."""

from __future__ import annotations

import asyncio
import struct

import pytest
import torch

from p2pdiloco.compress import CODECS, get_codec
from p2pdiloco.compress.wire import pack_deltas
from p2pdiloco.net.framing import read_frame
from p2pdiloco.net.stream_limits import Busy, StreamBudget, StreamLimits
from p2pdiloco.net.sync_rpc import RpcRefused
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.submissions import (
    FragmentRef,
    SubmissionHeader,
    payload_digest,
    seal_submission,
)
from p2pdiloco.sync.intake import Intake
from tests.test_record_rules import MANIFEST, RUN_ID

LIMITS = StreamLimits(max_streams_per_peer=2, max_streams=3, max_bytes_per_peer=100, max_bytes=150)


def test_streams_are_capped_per_peer_and_in_all_and_released() -> None:
    budget = StreamBudget(LIMITS)
    a1, _a2 = budget.open("a"), budget.open("a")
    with pytest.raises(Busy, match="one peer"):
        budget.open("a")
    budget.open("b")
    with pytest.raises(Busy, match="in all"):
        budget.open("c")
    a1.close()
    a1.close()  # idempotent
    budget.open("c")
    assert budget.total_streams == 3


def test_announced_bytes_are_capped_per_peer_and_in_all() -> None:
    budget = StreamBudget(LIMITS)
    a, b = budget.open("a"), budget.open("b")
    a.reserve(90)
    with pytest.raises(Busy, match="one peer"):
        a.reserve(20)
    b.reserve(60)
    with pytest.raises(Busy, match="in all"):
        b.reserve(10)
    a.close()
    b.reserve(10)
    assert budget.total_bytes == 70 and "a" not in budget.bytes


def test_for_request_scales_with_the_largest_request() -> None:
    lim = StreamLimits.for_request(100 << 20)
    assert lim.max_bytes_per_peer == 201 << 20 and lim.max_bytes == 400 << 20
    assert StreamLimits.for_request(1000).max_bytes == 64 << 20


def test_read_frame_admits_before_reading_the_body() -> None:
    async def go() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack(">I", 5_000_000))  # a big frame announced, none sent
        seen: list[int] = []

        def admit(size: int) -> None:
            seen.append(size)
            raise Busy("full")

        with pytest.raises(Busy):
            await read_frame(reader, 10_000_000, 1.0, admit)
        assert seen == [5_000_000]

    asyncio.run(go())


SHAPES = {"a.weight": (300, 7), "b.bias": (13,), "scalar": ()}


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_payload_limit_follows_the_codec_and_fits_a_real_pack(codec: str) -> None:
    manifest = MANIFEST.model_copy(update={"compression": codec})
    intake = Intake(manifest, SHAPES)
    c = get_codec(codec)
    pack = pack_deltas({n: c.encode(torch.randn(s)) for n, s in SHAPES.items()})
    numel = sum(max(1, torch.Size(s).numel()) for s in SHAPES.values())
    assert len(pack) <= intake.max_payload < len(pack) + 8192
    if codec != "none":
        assert intake.max_payload < 4 * numel + 8192  # below the old fp32 + 1 MiB


def _header(ident: Identity, nbytes: int) -> bytes:
    body = b"x" * 8
    header = SubmissionHeader(
        peer_id=ident.peer_id,
        base_version=0,
        steps=1,
        tokens=1,
        loss=1.0,
        codec="none",
        fragments=[FragmentRef(index=0, digest=payload_digest(body), nbytes=nbytes)],
    )
    return seal_submission(ident, RUN_ID, header)


def test_screen_verifies_the_header_and_fixes_the_payload_size() -> None:
    rejected: list[tuple[str, Reason]] = []
    intake = Intake(MANIFEST, SHAPES, RUN_ID, lambda p, d, code, t: rejected.append((p, code)))
    me = Identity.generate()
    assert intake.screen("submit", me.peer_id, _header(me, 1000)) == 1000
    assert intake.screen("propose", me.peer_id, b"anything") is None
    with pytest.raises(RpcRefused) as e:
        intake.screen("submit", me.peer_id, _header(me, intake.max_payload + 1))
    assert e.value.code is Reason.MALFORMED
    with pytest.raises(RpcRefused) as e:
        intake.screen("submit", "stream-peer", b"{}")
    assert e.value.code is Reason.INVALID_SIGNATURE
    assert rejected == [(me.peer_id, Reason.MALFORMED), ("stream-peer", Reason.INVALID_SIGNATURE)]
