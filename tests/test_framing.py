"""Length-prefixed frames: round trips, limits, truncation, bad control frames, timeouts."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from typing import Any

import pytest

from p2pdiloco.net.framing import (
    MAX_CONTROL_BYTES,
    FrameError,
    read_control,
    read_frame,
    write_control,
    write_frame,
)


class FakeWriter:
    """Collects what a StreamWriter would send."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data


def _reader(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_round_trip() -> None:
    control = {"op": "submit", "version": 3, "names": ["a", "b"], "ok": True}
    blobs = [b"", b"\x00\x01\xff" * 1000, bytes(range(256))]
    writer = FakeWriter()
    write_control(writer, control)  # type: ignore[arg-type]
    for blob in blobs:
        write_frame(writer, blob)  # type: ignore[arg-type]
    body = json.dumps(control, separators=(",", ":")).encode()
    assert bytes(writer.data[: 4 + len(body)]) == _frame(body)

    async def main() -> tuple[dict[str, Any], list[bytes]]:
        reader = _reader(bytes(writer.data))
        got = await read_control(reader, timeout=1.0)
        frames = [await read_frame(reader, limit=4096, timeout=1.0) for _ in blobs]
        assert reader.at_eof()
        return got, frames

    got, frames = asyncio.run(main())
    assert got == control
    assert frames == blobs


def test_frame_at_the_limit_is_read() -> None:
    async def main() -> bytes:
        return await read_frame(_reader(_frame(b"x" * 100)), limit=100, timeout=1.0)

    assert asyncio.run(main()) == b"x" * 100


def test_oversized_frame_is_refused_before_its_body() -> None:
    async def main() -> None:
        # Only the header arrives and the stream stays open: reading the body would hang
        # until the timeout, so a prompt "limit" error shows the body was never awaited.
        reader = _reader(struct.pack(">I", 101) + b"x" * 10, eof=False)
        t0 = time.monotonic()
        with pytest.raises(FrameError, match="over the limit"):
            await read_frame(reader, limit=100, timeout=5.0)
        assert time.monotonic() - t0 < 1.0
        assert await reader.read(10) == b"x" * 10  # untouched

    asyncio.run(main())


def test_oversized_control_frame_is_refused() -> None:
    async def main() -> None:
        reader = _reader(struct.pack(">I", MAX_CONTROL_BYTES + 1), eof=False)
        with pytest.raises(FrameError, match="over the limit"):
            await read_control(reader, timeout=5.0)

    asyncio.run(main())


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00\x00", _frame(b"hello")[:-1], struct.pack(">I", 10)],
    ids=["empty", "short-header", "short-body", "header-only"],
)
def test_truncated_stream(data: bytes) -> None:
    async def main() -> None:
        with pytest.raises(FrameError, match="closed"):
            await read_frame(_reader(data), limit=100, timeout=1.0)

    asyncio.run(main())


@pytest.mark.parametrize(
    "body",
    [b"[1, 2]", b'"text"', b"42", b"null", b"\xff\xfe{}", b"{not json", b"[" * 10_000],
    ids=["list", "string", "number", "null", "not-utf8", "bad-json", "deep-nesting"],
)
def test_bad_control_frame(body: bytes) -> None:
    async def main() -> None:
        with pytest.raises(FrameError, match="control frame"):
            await read_control(_reader(_frame(body)), timeout=1.0)

    asyncio.run(main())


def test_timeout_with_no_data() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        t0 = time.monotonic()
        with pytest.raises(FrameError, match="no frame within"):
            await read_frame(reader, limit=100, timeout=0.05)
        assert time.monotonic() - t0 < 1.0

    asyncio.run(main())


def test_timeout_in_the_middle_of_a_body() -> None:
    async def main() -> None:
        reader = _reader(_frame(b"0123456789")[:8], eof=False)
        with pytest.raises(FrameError, match="no frame within"):
            await read_frame(reader, limit=100, timeout=0.05)

    asyncio.run(main())
