"""Request/reply between nodes, behind one small interface.

The runtime, the syncer service and the state download speak to peers only through a
``Transport``: ``call(peer, op, ...)`` and ``serve(handler, limits)``. ``P2PTransport`` is the
real one (hivemind P2P streams, ``net.sync_rpc``); ``MemoryTransport`` connects nodes of one
process through a ``MemoryHub`` for fast driver tests and simulations. Both enforce the same
per-op frame limits, answer refusals with a ``Reason`` code, and count bytes, so a driver
tested in memory behaves as it does on the wire. A hub can take a peer down or slow it down,
which is how the tests inject faults.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hivemind.p2p import P2P

from p2pdiloco.net import sync_rpc
from p2pdiloco.net.sync_rpc import (
    REQUEST_TIMEOUT,
    Frames,
    Handler,
    RpcError,
    RpcRefused,
    Screen,
    check_request,
)
from p2pdiloco.protocol.reasons import Reason

_Served = tuple[Handler, Mapping[str, Sequence[int]], Screen | None]


class Transport(Protocol):
    me: str

    async def call(
        self,
        peer: str,
        op: str,
        *,
        args: dict[str, Any] | None = None,
        frames: Sequence[bytes] = (),
        reply_limit: int = 1 << 20,
        timeout: float = REQUEST_TIMEOUT,
    ) -> tuple[dict[str, Any], Frames]:
        """One request; raises RpcError (``code`` says why, ``refused`` if the peer said no)."""
        ...

    async def serve(
        self,
        handler: Handler,
        frame_limits: Mapping[str, Sequence[int]],
        screen: Screen | None = None,
    ) -> None:
        """Answer requests with ``handler``; ``frame_limits[op]`` bounds each request frame;
        ``screen`` checks a request's first frame before the rest is read (``sync_rpc.Screen``)."""
        ...


class P2PTransport:
    """hivemind P2P streams; ``addrs_of(peer)`` gives the multiaddrs to dial (heartbeats)."""

    def __init__(self, p2p: P2P, me: str, addrs_of: Callable[[str], list[str]]) -> None:
        self.p2p = p2p
        self.me = me
        self.addrs_of = addrs_of

    async def call(
        self,
        peer: str,
        op: str,
        *,
        args: dict[str, Any] | None = None,
        frames: Sequence[bytes] = (),
        reply_limit: int = 1 << 20,
        timeout: float = REQUEST_TIMEOUT,
    ) -> tuple[dict[str, Any], Frames]:
        return await sync_rpc.call(
            self.p2p,
            peer,
            op,
            args=args,
            frames=frames,
            reply_limit=reply_limit,
            addrs=self.addrs_of(peer),
            timeout=timeout,
        )

    async def serve(
        self,
        handler: Handler,
        frame_limits: Mapping[str, Sequence[int]],
        screen: Screen | None = None,
    ) -> None:
        await sync_rpc.serve(self.p2p, handler, frame_limits, screen=screen)


@dataclass
class MemoryHub:
    """Nodes of one process. ``down`` peers neither answer nor reach anyone; ``delay[peer]``
    seconds are added to every request that peer sends or answers."""

    handlers: dict[str, _Served] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)
    delay: dict[str, float] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)  # request + reply bytes sent, by peer
    received: dict[str, int] = field(default_factory=dict)
    # Sees each answered request: (sender, receiver, control, request frames, reply), where
    # control holds the op and the request's args. For tests.
    tap: Callable[[str, str, dict[str, Any], list[bytes], dict[str, Any]], None] | None = None
    # Loses a request before it is delivered when true for (sender, receiver, op, frames), as
    # a connection that drops would ("connection lost", not a refusal). For tests.
    lose: Callable[[str, str, str, Sequence[bytes]], bool] | None = None

    def transport(self, me: str) -> MemoryTransport:
        return MemoryTransport(self, me)

    def _count(self, src: str, dst: str, frames: Sequence[bytes]) -> None:
        n = sum(len(f) for f in frames)
        self.sent[src] = self.sent.get(src, 0) + n
        self.received[dst] = self.received.get(dst, 0) + n


class MemoryTransport:
    def __init__(self, hub: MemoryHub, me: str) -> None:
        self.hub = hub
        self.me = me

    async def call(
        self,
        peer: str,
        op: str,
        *,
        args: dict[str, Any] | None = None,
        frames: Sequence[bytes] = (),
        reply_limit: int = 1 << 20,
        timeout: float = REQUEST_TIMEOUT,
    ) -> tuple[dict[str, Any], Frames]:
        hub = self.hub
        target = hub.handlers.get(peer)
        if target is None or peer in hub.down or self.me in hub.down:
            raise RpcError(f"cannot open a stream to {peer}: unreachable")
        try:
            return await asyncio.wait_for(
                self._exchange(peer, target, op, args, frames, reply_limit), timeout
            )
        except TimeoutError:
            raise RpcError(f"{op} to {peer}: timed out") from None

    async def _exchange(
        self,
        peer: str,
        target: _Served,
        op: str,
        args: dict[str, Any] | None,
        frames: Sequence[bytes],
        reply_limit: int,
    ) -> tuple[dict[str, Any], Frames]:
        hub = self.hub
        handler, limits, screen = target
        pause = hub.delay.get(self.me, 0.0) + hub.delay.get(peer, 0.0)
        if pause:
            await asyncio.sleep(pause)
        if peer in hub.down or (hub.lose is not None and hub.lose(self.me, peer, op, frames)):
            raise RpcError(f"{op} to {peer}: connection lost")
        control = {**(args or {}), "op": op, "frames": len(frames)}
        try:
            _, frame_limits = check_request(limits, control)
        except RpcRefused as e:
            raise RpcError(str(e), refused=True, code=e.code) from None
        if any(len(f) > lim for f, lim in zip(frames, frame_limits, strict=True)):
            raise RpcError(f"{op} to {peer}: request frame over its limit (dropped)")
        try:  # as on the wire: the first frame is screened before the next is read
            exact = screen(op, self.me, bytes(frames[0])) if screen and len(frames) > 1 else None
            if exact is not None and len(frames[1]) != exact:
                raise RpcRefused(Reason.DIGEST_MISMATCH, "payload size differs from its header")
        except RpcRefused as e:
            raise RpcError(str(e)[:500], refused=True, code=e.code) from None
        hub._count(self.me, peer, frames)
        try:
            reply, out = await handler(op, self.me, control, [bytes(f) for f in frames])
        except RpcRefused as e:
            raise RpcError(str(e)[:500], refused=True, code=e.code) from None
        except Exception:  # as on the wire: a handler bug is an internal error for the caller
            raise RpcError("internal error", refused=True, code=Reason.INTERNAL) from None
        if any(len(f) > reply_limit for f in out):
            raise RpcError(
                f"{op} to {peer}: reply frame over {reply_limit} bytes", code=Reason.MALFORMED
            )
        hub._count(peer, self.me, out)
        if hub.tap is not None:
            hub.tap(self.me, peer, control, [bytes(f) for f in frames], reply)
        return {**reply, "ok": True, "frames": len(out)}, [bytes(f) for f in out]

    async def serve(
        self,
        handler: Handler,
        frame_limits: Mapping[str, Sequence[int]],
        screen: Screen | None = None,
    ) -> None:
        self.hub.handlers[self.me] = (handler, frame_limits, screen)
