"""Child side of the gossip plane: a py-libp2p gossipsub host driven over a pipe.

This module imports py-libp2p and must never import hivemind, directly or through a
``p2pdiloco`` module that does (ADR 0001): it runs in a process started with the ``spawn``
method by :class:`p2pdiloco.net.gossip.GossipProcess`, which holds the other end of the pipe.

Protocol (tuples over a ``multiprocessing`` Connection):

parent -> child
    ``("connect", maddr[, timeout])``, ``("subscribe", topic)``,
    ``("publish", topic, data)``, ``("peers",)``, ``("close",)``
child -> parent
    ``("ready", peer_id, maddrs)`` once, first; ``("fatal", description)`` instead if the
    host cannot start; ``("connected", maddr, ok, error)``; ``("peers", [peer ids])``;
    ``("message", topic, data, from_peer_id)``; ``("error", description)``.

A failing command is answered with ``("error", ...)`` and the loop goes on; the child exits
cleanly when the parent sends ``close`` or goes away (EOF / broken pipe).
"""

from __future__ import annotations

import contextlib
import logging
import time
from multiprocessing.connection import Connection
from typing import Any, cast

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.address_validation import expand_wildcard_address

from p2pdiloco.net.gossip_limits import MAX_MESSAGE_BYTES, MEND_INTERVAL

logger = logging.getLogger(__name__)

# Mesh parameters. Small meshes suit the small runs this project targets; the heartbeat is
# fast so that a fresh mesh grafts within a second or two.
DEGREE = 3
DEGREE_LOW = 2
DEGREE_HIGH = 4
HEARTBEAT_INTERVAL = 1
# Largest inbound pubsub RPC frame. One RPC may batch several messages (IWANT replies), so
# this stays at py-libp2p's default (1 MiB) rather than MAX_MESSAGE_BYTES: a frame above the
# limit resets the whole pubsub stream with that peer. Single messages above
# MAX_MESSAGE_BYTES are rejected by a topic validator instead (so they are not relayed).
MAX_INBOUND_RPC_BYTES = 1024 * 1024
# Messages waiting to be written to the parent; beyond this, received messages are dropped
# (gossip is an accelerator; everything is in the DHT too).
OUTBOX_SIZE = 1024
DEFAULT_CONNECT_TIMEOUT = 10.0
# After a dial succeeds, wait this long (at most) for the pubsub stream with the peer.
PUBSUB_STREAM_WAIT = 5.0
# A peer sending garbage is logged at most once per this many seconds.
GARBAGE_LOG_INTERVAL = 60.0


class _ParentGone(Exception):
    """The pipe to the parent is closed."""


def _within_size(_forwarder: ID, msg: Any) -> bool:
    return len(msg.data) <= MAX_MESSAGE_BYTES


class _SafePubsub(Pubsub):
    """py-libp2p's Pubsub with a peer's bad input contained to that peer.

    py-libp2p lets an undecodable RPC (``DecodeError``) or a failure while handling one escape
    the stream handler, which brings the whole host down: one 6-byte frame killed the child.
    Here the stream is reset, the peer dropped and the event logged (once a minute per peer);
    the host goes on. The peer may reconnect: gossip scoring, not this, decides who is banned.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.garbage: dict[str, int] = {}  # peer id -> bad RPCs and messages dropped
        self._logged_at: dict[str, float] = {}

    async def stream_handler(self, stream: Any) -> None:
        try:
            await super().stream_handler(stream)
        except Exception as e:
            peer_id = stream.muxed_conn.peer_id
            self._count(peer_id, f"dropped a malformed pubsub RPC ({type(e).__name__}: {e})")
            with contextlib.suppress(Exception):
                await stream.reset()
            self._handle_dead_peer(peer_id)

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        try:
            await super().push_msg(msg_forwarder, msg)
        except Exception as e:
            self._count(msg_forwarder, f"dropped a bad message ({type(e).__name__}: {e})")

    def _count(self, peer_id: ID, what: str) -> None:
        peer = peer_id.to_base58() if isinstance(peer_id, ID) else str(peer_id)
        self.garbage[peer] = n = self.garbage.get(peer, 0) + 1
        now = time.monotonic()
        if now - self._logged_at.get(peer, -GARBAGE_LOG_INTERVAL) >= GARBAGE_LOG_INTERVAL:
            self._logged_at[peer] = now
            logger.warning("gossip: peer %s %s; %d so far", peer, what, n)


class _Child:
    def __init__(self, conn: Connection, host: Any, pubsub: Pubsub) -> None:
        self.conn = conn
        self.host = host
        self.pubsub = pubsub
        self.my_id: ID = host.get_id()
        self.my_id_bytes = self.my_id.to_bytes()
        self.out_send, self.out_recv = trio.open_memory_channel[tuple[Any, ...]](OUTBOX_SIZE)
        self.subscribed: set[str] = set()
        self.dropped = 0
        self.nursery: trio.Nursery | None = None
        self.ready = False

    # -- writing to the parent ------------------------------------------------------------

    async def writer(self) -> None:
        async for item in self.out_recv:
            try:
                await trio.to_thread.run_sync(self.conn.send, item)
            except (EOFError, OSError) as e:
                raise _ParentGone from e

    async def reply(self, item: tuple[Any, ...]) -> None:
        await self.out_send.send(item)

    def post_message(self, item: tuple[Any, ...]) -> None:
        try:
            self.out_send.send_nowait(item)
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("gossip: parent is slow, dropped %d messages", self.dropped)

    # -- commands ---------------------------------------------------------------------------

    async def reader(self) -> None:
        while True:
            try:
                cmd = await trio.to_thread.run_sync(  # type: ignore[call-arg]  # TypeVarTuple
                    self.conn.recv, abandon_on_cancel=True
                )
            except (EOFError, OSError) as e:
                raise _ParentGone from e
            if isinstance(cmd, tuple) and cmd[:1] == ("close",):
                return
            try:
                await self.handle(cmd)
            except Exception as e:
                logger.debug("gossip: command %s failed", _describe(cmd), exc_info=True)
                await self.reply(("error", f"{_describe(cmd)}: {type(e).__name__}: {e}"))

    async def handle(self, cmd: Any) -> None:
        if not isinstance(cmd, tuple) or not cmd or not isinstance(cmd[0], str):
            raise ValueError("malformed command")
        kind, args = cmd[0], cmd[1:]
        if kind == "connect":
            maddr = str(args[0])
            timeout = float(args[1]) if len(args) > 1 else DEFAULT_CONNECT_TIMEOUT
            assert self.nursery is not None
            # Dials run concurrently so a slow peer does not hold up other commands.
            self.nursery.start_soon(self.connect, maddr, timeout)
        elif kind == "subscribe":
            await self.subscribe(str(args[0]))
        elif kind == "publish":
            topic, data = str(args[0]), bytes(args[1])
            if len(data) > MAX_MESSAGE_BYTES:
                raise ValueError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
            await self.pubsub.publish(topic, data)
        elif kind == "peers":
            await self.reply(("peers", [p.to_base58() for p in list(self.pubsub.peers)]))
        else:
            raise ValueError(f"unknown command {kind!r}")

    async def connect(self, maddr: str, timeout: float) -> None:
        ok, error = False, ""
        try:
            with trio.fail_after(timeout):
                info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
                if info.peer_id == self.my_id:
                    raise ValueError("refusing to dial ourselves")
                await self.host.connect(info)
            ok = True
            # Give the pubsub stream a moment, so that peers() lists the peer on return.
            with contextlib.suppress(trio.TooSlowError):
                await self.pubsub.wait_for_peer(info.peer_id, timeout=PUBSUB_STREAM_WAIT)
        except trio.TooSlowError:
            error = f"timed out after {timeout:g} s"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        await self.reply(("connected", maddr, ok, error))

    async def subscribe(self, topic: str) -> None:
        if topic in self.subscribed:
            return
        self.pubsub.set_topic_validator(topic, _within_size, is_async_validator=False)
        subscription = await self.pubsub.subscribe(topic)
        self.subscribed.add(topic)
        assert self.nursery is not None
        self.nursery.start_soon(self.pump, topic, subscription)

    async def pump(self, topic: str, subscription: Any) -> None:
        while True:
            msg = await subscription.get()
            if msg.from_id == self.my_id_bytes:
                continue  # our own publication, delivered to local subscribers
            data = bytes(msg.data)
            if len(data) > MAX_MESSAGE_BYTES:
                continue
            try:
                sender = ID(msg.from_id).to_base58()
            except Exception:
                continue
            self.post_message(("message", topic, data, sender))


def _describe(cmd: Any) -> str:
    if isinstance(cmd, tuple) and cmd:
        return str(cmd[0])[:40]
    return type(cmd).__name__


def build_pubsub(seed: bytes, listen_host: str, port: int) -> tuple[Any, Pubsub, Any]:
    """This project's gossipsub stack for the key of ``seed``: (host, pubsub, listen address);
    run the host with ``host.run([listen])`` and the pubsub and its router as services."""
    if len(seed) != 32:
        raise ValueError(f"seed must be 32 bytes, got {len(seed)}")
    key_pair = create_new_key_pair(seed)
    listen = multiaddr.Multiaddr(f"/ip4/{listen_host}/tcp/{int(port)}")
    host = new_host(key_pair=key_pair, listen_addrs=[listen])
    router = GossipSub(
        protocols=[PROTOCOL_ID_V11, PROTOCOL_ID],
        degree=DEGREE,
        degree_low=DEGREE_LOW,
        degree_high=DEGREE_HIGH,
        heartbeat_initial_delay=0.1,
        heartbeat_interval=HEARTBEAT_INTERVAL,
        # py-libp2p silently drops messages beyond this rate per forwarding peer and
        # topic (default 10/s); bursts of one announcement per peer are legitimate here.
        max_messages_per_topic_per_second=100.0,
    )
    pubsub = _SafePubsub(host, router, max_inbound_rpc_size=MAX_INBOUND_RPC_BYTES)
    return host, pubsub, listen


def mend_links(pubsub: Pubsub) -> tuple[int, int]:
    """Repair what py-libp2p does once per link and never again; returns (peers told our
    subscriptions, pubsub streams reopened).

    A peer learns our subscriptions from the hello that opens our pubsub stream to it, and
    from nothing else. If that hello is lost (a signed peer record older than one it already
    holds makes it drop the whole RPC; a stream reset races a re-registration that forgets
    them) it never sends us a message on our topics while the link lives: it queues them as
    for a peer not yet identified, then drops them. And a stream that failed to open with an
    error py-libp2p does not retry (``StreamFailure``) leaves a connected peer with no pubsub
    stream for good. Either leaves a node deaf to a peer's gossip for the life of the link
    (seen once, in a CI run; which of the two is not known: ADR 0069). So every
    :data:`MEND_INTERVAL`: our subscriptions are told again to every pubsub peer (a receiver
    ignores ones it knows), and a connected peer without a stream gets one."""
    told = 0
    if pubsub.topic_ids:
        hello = pubsub.get_hello_packet()
        for peer in list(pubsub.peers):
            pubsub.router.send_rpc(peer, hello, priority=True)  # type: ignore[attr-defined]
            told += 1
    reopened = 0
    for peer in pubsub.host.get_network().get_connections_map():
        if peer not in pubsub.peers and pubsub._peer_is_connected(peer):
            pubsub._schedule_peer_stream_retry(peer)  # one retry task per peer at most
            reopened += 1
    return told, reopened


async def _amain(
    conn: Connection, seed: bytes, listen_host: str, port: int, topics: list[str]
) -> None:
    try:
        host, pubsub, listen = build_pubsub(seed, listen_host, port)
    except Exception as e:
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        raise

    child = _Child(conn, host, pubsub)
    try:
        await _serve(child, listen, topics)
    except BaseException as e:
        if _only(e, _ParentGone):
            logger.debug("gossip: parent went away, exiting")
            return
        if not child.ready:
            with contextlib.suppress(Exception):
                conn.send(("fatal", _leaf_errors(e)))
        raise


async def _serve(child: _Child, listen: Any, topics: list[str]) -> None:
    host, pubsub = child.host, child.pubsub
    router = cast(GossipSub, pubsub.router)
    async with host.run(listen_addrs=[listen]), trio.open_nursery() as nursery:
        child.nursery = nursery
        async with background_trio_service(pubsub), background_trio_service(router):
            await pubsub.wait_until_ready()
            for topic in topics:
                await child.subscribe(topic)
            peer_id = child.my_id.to_base58()
            maddrs = [f"{a}/p2p/{peer_id}" for a in _concrete(host.get_transport_addrs())]
            await trio.to_thread.run_sync(child.conn.send, ("ready", peer_id, maddrs))
            child.ready = True
            async with trio.open_nursery() as inner:
                inner.start_soon(child.writer)
                inner.start_soon(_mend_forever, pubsub)
                await child.reader()  # returns on ("close",)
                inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()


async def _mend_forever(pubsub: Pubsub) -> None:
    """:func:`mend_links` every period; a mend that fails (py-libp2p's state changed under it)
    is logged and tried again next period, never ends the child."""
    while True:
        await trio.sleep(MEND_INTERVAL)
        try:
            _, reopened = mend_links(pubsub)
        except Exception as e:
            logger.debug("gossip: mending links failed (%s: %s)", type(e).__name__, e)
            continue
        if reopened:
            logger.debug("gossip: reopening the pubsub stream to %d connected peers", reopened)


def _concrete(addrs: list[Any]) -> list[Any]:
    """Listen addresses with a wildcard IP (0.0.0.0) replaced by the interfaces' IPs."""
    out: list[Any] = []
    for addr in addrs:
        if addr.value_for_protocol("ip4") == "0.0.0.0":
            try:
                out.extend(expand_wildcard_address(addr) or [addr])
            except Exception:
                out.append(addr)
        else:
            out.append(addr)
    return out


def _only(e: BaseException, cls: type[BaseException]) -> bool:
    if isinstance(e, BaseExceptionGroup):
        return all(_only(sub, cls) for sub in e.exceptions)
    return isinstance(e, cls)


def _leaf_errors(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_leaf_errors(sub) for sub in e.exceptions)
    return f"{type(e).__name__}: {e}"


def run_child(
    conn: Connection, seed: bytes, listen_host: str, port: int, topics: list[str]
) -> None:
    """Entry point of the gossip child process; returns when told to close or orphaned."""
    from p2pdiloco.net.observe import install_noise_filter

    install_noise_filter()  # py-libp2p logs every failed dial; one summary line per minute
    try:
        trio.run(_amain, conn, bytes(seed), listen_host, port, list(topics))
    except* (EOFError, BrokenPipeError, ConnectionResetError):
        pass
    except* KeyboardInterrupt:
        pass
