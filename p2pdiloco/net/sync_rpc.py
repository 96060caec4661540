"""The sync protocol's request/reply transport over hivemind P2P streams.

One stream per request on protocol ``/p2pdiloco/sync/1``: the caller writes a control frame
``{"op": ..., "frames": n, ...}`` and n binary frames; the server answers with a control frame
``{"ok": bool, "frames": m, ...}`` and m binary frames. Each op has its own size limit per
request frame, checked before the bytes are read, so an oversized or endless request costs the
server nothing; a submission's signed header is verified before its payload is read; and
concurrent streams and announced bytes in flight are capped per peer and in all
(``net.stream_limits``), so many big streams at once are answered ``busy`` instead of buffered. Ops and their frames are listed in ``docs/protocol.md`` (Sync transport).

The server side only frames and dispatches; what a request means is decided by the
``handler`` (the node's sync service), which returns ``(control, frames)`` or raises
``RpcRefused`` with a ``Reason`` code and text that are sent back to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from multiaddr import Multiaddr

from p2pdiloco.net.framing import FrameError, read_control, read_frame, write_control, write_frame
from p2pdiloco.net.stream_limits import Busy, StreamBudget, StreamLimits, Ticket
from p2pdiloco.protocol.reasons import Reason

log = logging.getLogger(__name__)

SYNC_PROTOCOL = "/p2pdiloco/sync/1"
REQUEST_TIMEOUT = 30.0
LINGER_S = 2.0  # how long a refused, partly read request's stream stays open for the reply
MAX_LINGERING = 64  # refused streams held open at once; beyond, closed at once (reply may be lost)
# Bytes of sync traffic this process sent and received (both roles), for dashboards and metrics;
# of those, its own learner's: its deltas as uploaded (``submit`` asking for a relay, ADR 0028)
# and what it downloaded to follow the run (updates, certificates, state indexes and chunks).
TRAFFIC = {"up": 0, "down": 0, "learner_up": 0, "learner_down": 0}
_FOLLOW_OPS = frozenset({"update", "cert", "index", "chunk"})

Frames = list[bytes]
Handler = Callable[[str, str, dict[str, Any], Frames], Awaitable[tuple[dict[str, Any], Frames]]]
# (op, peer, first request frame) -> exact size of the next frame or None; raises RpcRefused.
Screen = Callable[[str, str, bytes], int | None]


class RpcRefused(Exception):
    """Raised by a handler: the request is answered ``ok: false`` with this code and text."""

    def __init__(self, code: Reason, text: str) -> None:
        super().__init__(text)
        self.code = code


class RpcError(Exception):
    """The call failed: peer unreachable or stream broken (code UNREACHABLE, ``refused`` False),
    a malformed reply (MALFORMED), or the peer refused (``refused`` True, the peer's code)."""

    def __init__(self, reason: str, refused: bool = False, code: Reason = Reason.UNREACHABLE):
        super().__init__(reason)
        self.refused = refused
        self.code = code


def check_request(
    frame_limits: Mapping[str, Sequence[int]], control: dict[str, Any]
) -> tuple[str, Sequence[int]]:
    """The op of a request and its per-frame limits; RpcRefused if unknown or too many frames."""
    op = control.get("op")
    limits = frame_limits.get(op) if isinstance(op, str) else None
    count = control.get("frames", 0)
    if limits is None or not isinstance(op, str):
        raise RpcRefused(Reason.UNKNOWN_OP, f"unknown op {str(op)[:32]!r}")
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= len(limits):
        raise RpcRefused(Reason.MALFORMED, f"op {op} takes at most {len(limits)} frames")
    return op, limits[:count]


def refusal(reply: dict[str, Any]) -> RpcError:
    """The error for an ``ok: false`` reply."""
    text = str(reply.get("error", "refused"))[:500]
    return RpcError(text, refused=True, code=Reason.parse(reply.get("code")))


async def read_request(
    reader: asyncio.StreamReader,
    peer: str,
    op: str,
    limits: Sequence[int],
    ticket: Ticket,
    screen: Screen | None,
) -> Frames:
    """The request frames after the control frame. Each frame's announced size is reserved on
    ``ticket`` before its bytes are read; after the first frame, ``screen`` (if any) checks it
    (a submission's signed header) and may fix the exact size of the next one."""
    frames: Frames = []
    exact: int | None = None

    def admit(size: int) -> None:
        if exact is not None and size != exact:
            text = f"payload of {size} bytes, not the {exact} of its signed digest entry"
            log.warning("rejected input from %s: [%s] %s", peer, Reason.DIGEST_MISMATCH.value, text)
            raise RpcRefused(Reason.DIGEST_MISMATCH, text)
        ticket.reserve(size)

    for i, limit in enumerate(limits):
        if i == 1 and screen is not None:
            exact = screen(op, peer, frames[0])
        frames.append(await read_frame(reader, limit, REQUEST_TIMEOUT, admit))
    return frames


def _refuse(writer: asyncio.StreamWriter, code: Reason, text: str) -> None:
    write_control(writer, {"ok": False, "code": code.value, "error": text[:500], "frames": 0})


async def serve(
    p2p: P2P,
    handler: Handler,
    frame_limits: Mapping[str, Sequence[int]],
    *,
    screen: Screen | None = None,
    stream_limits: StreamLimits | None = None,
) -> None:
    """Register the sync protocol. ``frame_limits[op]`` bounds each request frame of ``op``;
    ``screen`` checks a request's first frame before the rest is read (see ``read_request``);
    ``stream_limits`` caps concurrent streams and in-flight bytes per peer and in all (default: from
    the largest request the limits allow), answering ``busy`` over a cap."""
    largest = max((sum(v) for v in frame_limits.values()), default=0)
    budget = StreamBudget(stream_limits or StreamLimits.for_request(largest))
    lingering = [0]  # refused streams held open for their reply (at most MAX_LINGERING)

    async def on_stream(
        info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = str(info.peer_id)
        ticket: Ticket | None = None
        unread = True  # refused before the whole request was read
        try:
            control = await read_control(reader, REQUEST_TIMEOUT)
            op, limits = check_request(frame_limits, control)
            ticket = budget.open(peer)
            frames = await read_request(reader, peer, op, limits, ticket, screen)
            unread = False
            TRAFFIC["down"] += sum(len(f) for f in frames)
            reply, out = await handler(op, peer, control, frames)
            TRAFFIC["up"] += sum(len(f) for f in out)
            write_control(writer, {**reply, "ok": True, "frames": len(out)})
            for f in out:
                write_frame(writer, f)
        except RpcRefused as e:
            _refuse(writer, e.code, str(e))
        except Busy as e:
            _refuse(writer, Reason.BUSY, f"busy: {e}")
        except FrameError as e:
            log.warning("dropped sync request from %s: %s", peer, e)
        except asyncio.CancelledError:  # the node is stopping: end quietly (a cancelled stream
            return  # task makes asyncio's stream callback log a CancelledError traceback)
        except Exception:  # a bug in a handler must not kill the node's P2P loop
            log.exception("sync request from %s failed", peer)
            write_control(
                writer,
                {
                    "ok": False,
                    "code": Reason.INTERNAL.value,
                    "error": "internal error",
                    "frames": 0,
                },
            )
        finally:
            if ticket is not None:
                ticket.close()
        with contextlib.suppress(Exception):  # the caller went away: nothing to do
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)
            if unread and lingering[0] < MAX_LINGERING:
                lingering[0] += 1
                try:
                    await _linger(reader)
                finally:
                    lingering[0] -= 1
        writer.close()

    await p2p.add_binary_stream_handler(SYNC_PROTOCOL, on_stream)


async def _linger(reader: asyncio.StreamReader) -> None:
    """After refusing a request not yet read in full: let the caller read the refusal before the
    stream closes (closing with unread bytes resets it, and the reset loses the reply). The rest
    is read and dropped 64 KiB at a time, for at most ``LINGER_S`` seconds or until the caller
    closes; nothing is kept."""
    deadline = asyncio.get_running_loop().time() + LINGER_S
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        if not await asyncio.wait_for(reader.read(64 * 1024), left):
            return


async def _send_then_reply(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float
) -> dict[str, Any]:
    """Flush the request while already reading the reply: a server that refuses a request
    before reading all of it (``busy``, a bad header) answers and closes, and that answer must
    win over the broken pipe the rest of our write then meets. If the write broke and no reply
    came, the write's error is raised (the call is ``unreachable``, not ``malformed``)."""
    reply = asyncio.ensure_future(read_control(reader, timeout))
    drain = asyncio.ensure_future(asyncio.wait_for(writer.drain(), timeout))
    try:
        await asyncio.wait({reply, drain}, return_when=asyncio.FIRST_COMPLETED)
        broken: BaseException | None = None
        if not reply.done():
            try:
                await drain
            except (ConnectionError, OSError) as e:
                broken = e
        try:
            return await reply
        except FrameError:
            if broken is not None:
                raise broken from None
            raise
    finally:
        for task in (reply, drain):
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: an early reply makes the broken drain expected


async def call(
    p2p: P2P,
    peer_id: str,
    op: str,
    *,
    args: dict[str, Any] | None = None,
    frames: Sequence[bytes] = (),
    reply_limit: int = 1 << 20,
    addrs: Sequence[str] = (),
    timeout: float = REQUEST_TIMEOUT,
) -> tuple[dict[str, Any], Frames]:
    """Send one request; the reply's control dict and frames (each at most ``reply_limit``).

    ``addrs`` (the peer's multiaddrs from its heartbeat) are dialled first when given, so a peer
    this daemon has never met can be reached. Raises RpcError.
    """
    try:
        peer = PeerID.from_base58(peer_id)
        if addrs:
            try:
                await asyncio.wait_for(
                    p2p._client.connect(peer, [Multiaddr(a) for a in addrs[:8]]), 10.0
                )
            except Exception as e:  # the stream open below may still route through a relay
                log.debug("connect to %s failed: %s", peer_id, e)
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(peer, SYNC_PROTOCOL), timeout
        )
    except Exception as e:
        raise RpcError(f"cannot open a stream to {peer_id}: {e or type(e).__name__}") from None
    try:
        write_control(writer, {**(args or {}), "op": op, "frames": len(frames)})
        for f in frames:
            write_frame(writer, f)
        sent = sum(len(f) for f in frames)
        TRAFFIC["up"] += sent
        if op == "submit" and (args or {}).get("relay") is True:
            TRAFFIC["learner_up"] += sent
        reply = await _send_then_reply(reader, writer, timeout)
        count = reply.get("frames", 0)
        if not isinstance(count, int) or not 0 <= count <= 64:
            raise RpcError(f"{peer_id} sent a malformed reply", code=Reason.MALFORMED)
        out = [await read_frame(reader, reply_limit, timeout) for _ in range(count)]
        got = sum(len(f) for f in out)
        TRAFFIC["down"] += got
        if op in _FOLLOW_OPS and (args or {}).get("part") != "committee":  # a syncer's duty
            TRAFFIC["learner_down"] += got
    except FrameError as e:
        raise RpcError(f"{op} to {peer_id}: {e}", code=Reason.MALFORMED) from None
    except (ConnectionError, OSError, TimeoutError) as e:
        raise RpcError(f"{op} to {peer_id}: {e or type(e).__name__}") from None
    finally:
        writer.close()
    if not reply.get("ok"):
        raise refusal(reply)
    return reply, out
