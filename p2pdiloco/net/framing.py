"""Length-prefixed frames over a P2P byte stream, with a size limit checked before reading.

A frame is a 4-byte big-endian length and that many bytes. Every request and reply of the sync
protocol is a short sequence of frames: a JSON control frame first, then binary frames
(envelopes, payloads, chunks). A peer that announces a frame over the reader's limit, or stalls,
gets the stream closed; nothing it sent is parsed.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Callable
from typing import Any

_LEN = struct.Struct(">I")
MAX_CONTROL_BYTES = 64 * 1024


class FrameError(Exception):
    """A frame over the limit, a truncated stream, a timeout or an undecodable control frame."""


async def read_frame(
    reader: asyncio.StreamReader,
    limit: int,
    timeout: float,
    admit: Callable[[int], None] | None = None,
) -> bytes:
    """One frame of at most ``limit`` bytes; FrameError otherwise. ``admit(size)`` is called
    with the announced size before any of the frame's bytes are read; whatever it raises
    propagates and the frame stays unread."""
    try:
        head = await asyncio.wait_for(reader.readexactly(_LEN.size), timeout)
        (size,) = _LEN.unpack(head)
        if size > limit:
            raise FrameError(f"frame of {size} bytes is over the limit of {limit}")
        if admit is not None:
            admit(size)
        return await asyncio.wait_for(reader.readexactly(size), timeout)
    except asyncio.IncompleteReadError:
        raise FrameError("stream closed in the middle of a frame") from None
    except TimeoutError:
        raise FrameError(f"no frame within {timeout:.0f} s") from None
    except (ConnectionError, OSError) as e:
        raise FrameError(f"stream error: {e}") from None


def write_frame(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(_LEN.pack(len(data)) + data)


async def read_control(reader: asyncio.StreamReader, timeout: float) -> dict[str, Any]:
    """A JSON object frame (at most MAX_CONTROL_BYTES); FrameError if it is anything else."""
    raw = await read_frame(reader, MAX_CONTROL_BYTES, timeout)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FrameError("control frame is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise FrameError("control frame must be a JSON object")
    return obj


def write_control(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    write_frame(writer, json.dumps(obj, separators=(",", ":")).encode())
