"""Parent side of the gossip plane: drives a py-libp2p gossipsub host in a child process.

hivemind and py-libp2p cannot share an interpreter (ADR 0001), so the gossipsub host runs in
a child started with the ``spawn`` method (:mod:`p2pdiloco.net.gossip_host`), and this module
talks to it over a pipe. It imports neither stack: stdlib and ``multiprocessing`` only.

Gossip is an accelerator (everything gossiped is also in the DHT): when the child dies,
:attr:`GossipProcess.alive` turns False, :meth:`~GossipProcess.get` returns None and sends
raise :class:`GossipError` until a new child is up: the process restarts it with back-off
(same key, same port, same topics; :attr:`GossipProcess.restarts` counts them), unless it was
made with ``restart=False``. The child dies with its parent (:mod:`p2pdiloco.net.lifeline`).

    with GossipProcess(seed, topics=["t"]) as gossip:
        gossip.connect("/ip4/127.0.0.1/tcp/4001/p2p/12D3Koo...")
        gossip.publish("t", b"hello")
        msg = gossip.get(timeout=5.0)   # GossipMessage(topic, data, from_peer) or None
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any, NamedTuple

from p2pdiloco.net import gossip_spawn, lifeline
from p2pdiloco.net.gossip_limits import MAX_MESSAGE_BYTES
from p2pdiloco.net.gossip_spawn import stop_child

logger = logging.getLogger(__name__)

# Back-off between restarts of a dead child: doubles from the first to the last value, and
# starts over once a child has lived for STABLE_AFTER seconds.
RESTART_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)
# A child ended by SIGTERM (or not reaped yet a second after its pipe closed) most likely got
# the signal its whole process group got: if the node closes within this many seconds, nothing
# is logged or restarted. A child killed otherwise (SIGKILL, a crash) is restarted at once.
_GROUP_ENDINGS = (None, -signal.SIGTERM)
SHUTDOWN_GRACE = 3.0
STABLE_AFTER = 60.0

_CLOSED = object()  # wakes get() once the child is gone


class GossipError(Exception):
    """The gossip child is not running, did not start, or refused a request."""


class GossipMessage(NamedTuple):
    topic: str
    data: bytes
    from_peer: str  # base58 peer id of the original publisher


class GossipProcess:
    """A gossipsub host in a child process, with the same peer id as ``seed``'s key.

    Thread-safe: any thread may publish, connect or read. Received messages are buffered
    in an unbounded queue by a reader thread, so call :meth:`get` regularly.
    """

    def __init__(
        self,
        seed: bytes,
        *,
        topics: Sequence[str] = (),
        listen_host: str = "127.0.0.1",
        port: int = 0,
        restart: bool = True,
    ) -> None:
        if len(seed) != 32:
            raise ValueError(f"seed must be 32 bytes, got {len(seed)}")
        if isinstance(topics, str):
            raise TypeError("topics must be a sequence of strings, not a string")
        self._seed = bytes(seed)
        self._topics = list(topics)
        self._listen_host = listen_host
        self._port = int(port)
        self._restart = restart
        self._closing = threading.Event()
        self._proc: Any = None  # multiprocessing SpawnProcess
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._messages: queue.Queue[Any] = queue.Queue()
        # Waiters for replies, by reply key: ("connected", maddr) or ("peers",).
        self._waiters: dict[tuple[str, ...], collections.deque[queue.Queue[Any]]] = {}
        self._peer_id: str | None = None
        self._maddrs: list[str] = []
        self._started = False
        self._dead = False
        self._closed = False
        self._executor: ThreadPoolExecutor | None = None
        self.errors: collections.deque[str] = collections.deque(maxlen=100)
        """The latest ``error`` reports from the child (failed commands), newest last."""
        self.restarts = 0
        """How many times a dead child was replaced by a new one."""

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Spawn the child and wait until its host listens; GossipError otherwise."""
        with self._state_lock:
            if self._started:
                raise GossipError("gossip process already started")
            self._started = True
        try:
            self._install(*self._spawn(self._port, timeout))
        except BaseException:
            self._dead = True
            raise
        self._reader = threading.Thread(
            target=self._supervise, name="p2pdiloco-gossip-reader", daemon=True
        )
        self._reader.start()

    def _spawn(self, port: int, timeout: float) -> tuple[Any, Connection, str, list[str]]:
        """A new child listening on ``port``: (process, pipe, peer id, maddrs)."""
        args = (self._seed, self._listen_host, port, list(self._topics), os.getpid())
        proc, parent_conn = gossip_spawn.start_child(*args)
        lifeline.guard(proc.pid)
        deadline = time.monotonic() + timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise GossipError(f"gossip child not ready within {timeout:g} s")
                if self._closing.is_set():
                    raise GossipError("gossip process is closing")
                ready = wait([parent_conn, proc.sentinel], min(remaining, 0.5))
                if parent_conn in ready:
                    try:
                        msg = parent_conn.recv()
                    except (EOFError, OSError):
                        proc.join(timeout=5.0)
                        raise GossipError(
                            f"gossip child exited during startup (exit code {proc.exitcode})"
                        ) from None
                    if msg[0] == "ready":
                        return proc, parent_conn, str(msg[1]), [str(a) for a in msg[2]]
                    if msg[0] == "fatal":
                        proc.join(timeout=5.0)
                        raise GossipError(
                            f"gossip child failed to start: {msg[1]} (exit code {proc.exitcode})"
                        )
                    logger.debug("gossip: ignoring %r before ready", msg[0])
                elif proc.sentinel in ready:
                    proc.join(timeout=1.0)
                    raise GossipError(
                        f"gossip child exited during startup (exit code {proc.exitcode})"
                    )
        except BaseException:
            stop_child(proc, timeout=1.0)
            parent_conn.close()
            raise

    def _install(self, proc: Any, conn: Connection, peer_id: str, maddrs: list[str]) -> None:
        with self._state_lock:
            if self._closed:  # close() raced a restart: this child is ours to stop
                stop_child(proc, timeout=1.0)
                conn.close()
                raise GossipError("gossip process is closing")
            self._proc, self._conn = proc, conn
            self._peer_id, self._maddrs = peer_id, maddrs
            self._dead = False

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child (politely, then by force); idempotent, never raises for a dead child."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        self._closing.set()
        if self._proc is None:
            return
        with contextlib.suppress(Exception):
            self._send(("close",), check=False)
        stop_child(self._proc, timeout)
        if self._reader is not None:
            self._reader.join(timeout=max(timeout, 1.0))
        stop_child(self._proc, 1.0)  # a restart may have installed a new child meanwhile
        self._mark_dead()
        if self._conn is not None:
            self._conn.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def __enter__(self) -> GossipProcess:
        if not self._started:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- properties -----------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        if self._peer_id is None:
            raise GossipError("gossip process not started")
        return self._peer_id

    @property
    def maddrs(self) -> list[str]:
        """Listen multiaddrs, each ending in ``/p2p/<peer id>``."""
        return list(self._maddrs)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return (
            self._peer_id is not None
            and not self._dead
            and not self._closed
            and self._proc is not None
            and self._proc.is_alive()
        )

    # -- requests -------------------------------------------------------------------------

    def subscribe(self, topic: str) -> None:
        """Subscribe now, and in every child that replaces this one."""
        self._send(("subscribe", str(topic)))
        with self._state_lock:
            if str(topic) not in self._topics:
                self._topics.append(str(topic))

    def publish(self, topic: str, data: bytes) -> None:
        """Hand ``data`` to the child for publication (fire and forget)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_MESSAGE_BYTES:
            raise GossipError(
                f"gossip message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit"
            )
        self._send(("publish", str(topic), data))

    def connect(self, maddr: str, timeout: float = 10.0) -> bool:
        """Dial ``maddr`` (which must end in ``/p2p/<peer id>``); True once connected."""
        reply = self._request(("connect", maddr, timeout), ("connected", maddr), timeout + 2.0)
        if reply is None:
            logger.debug("gossip: no reply to connect %s within %g s", maddr, timeout)
            return False
        _, _, ok, error = reply
        if not ok:
            logger.debug("gossip: connect %s failed: %s", maddr, error)
        return bool(ok)

    def peers(self, timeout: float = 5.0) -> list[str]:
        """Peer ids the child has a pubsub stream with."""
        reply = self._request(("peers",), ("peers",), timeout)
        if reply is None:
            raise GossipError(f"gossip child did not answer within {timeout:g} s")
        return [str(p) for p in reply[1]]

    def get(self, timeout: float | None = None) -> GossipMessage | None:
        """Next received message; None on timeout or once the child is gone."""
        try:
            item = self._messages.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _CLOSED:
            if self._closed or not self._restart:
                self._messages.put(_CLOSED)  # gone for good: wake the next reader too
            return None
        assert isinstance(item, GossipMessage)
        return item

    async def aget(self, timeout: float | None = None) -> GossipMessage | None:
        """:meth:`get` for asyncio code (runs in a private thread pool).

        A message taken by a cancelled ``aget`` is put back in the queue, not lost.
        """
        if self._executor is None:
            with self._state_lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(2, thread_name_prefix="gossip-aget")
        future = self._executor.submit(self.get, timeout)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            future.add_done_callback(self._requeue)  # runs in the worker, loop or not
            raise

    def _requeue(self, future: Future[GossipMessage | None]) -> None:
        if not future.cancelled() and future.exception() is None:
            msg = future.result()
            if msg is not None:
                self._messages.put(msg)

    # -- plumbing -------------------------------------------------------------------------

    def _send(self, item: tuple[Any, ...], *, check: bool = True) -> None:
        if check and not self.alive:
            raise GossipError("gossip child is not running")
        conn = self._conn
        if conn is None:
            raise GossipError("gossip process not started")
        try:
            with self._send_lock:
                conn.send(item)
        except (OSError, EOFError, ValueError) as e:
            self._mark_dead()
            raise GossipError(f"gossip child is gone: {e}") from e

    def _request(
        self, item: tuple[Any, ...], key: tuple[str, ...], timeout: float
    ) -> tuple[Any, ...] | None:
        box: queue.Queue[Any] = queue.Queue(maxsize=1)
        with self._state_lock:
            self._waiters.setdefault(key, collections.deque()).append(box)
        try:
            self._send(item)
            try:
                reply = box.get(timeout=timeout)
            except queue.Empty:
                return None
            if reply is _CLOSED:
                raise GossipError("gossip child is gone")
            assert isinstance(reply, tuple)
            return reply
        finally:
            with self._state_lock:
                boxes = self._waiters.get(key)
                if boxes is not None:
                    with contextlib.suppress(ValueError):
                        boxes.remove(box)
                    if not boxes:
                        del self._waiters[key]

    def _deliver_reply(self, key: tuple[str, ...], reply: Any) -> None:
        with self._state_lock:
            boxes = self._waiters.get(key)
            box = boxes.popleft() if boxes else None
            if boxes is not None and not boxes:
                del self._waiters[key]
        if box is None:
            logger.debug("gossip: unexpected reply %r", key)
        else:
            box.put(reply)

    def _supervise(self) -> None:
        """Read the child's messages; when it dies, start a new one with back-off."""
        attempt = 0
        while True:
            born = time.monotonic()
            self._read_loop()
            proc = self._proc
            wait([proc.sentinel], 1.0)  # let it be reaped, for the exit code
            if proc.exitcode in _GROUP_ENDINGS and self._closing.wait(SHUTDOWN_GRACE):
                return  # SIGTERM to the process group: this node is stopping too
            if not self._closed:
                logger.warning(
                    "gossip child is gone (exit code %s); %s",
                    proc.exitcode,
                    "restarting it" if self._restart else "gossip disabled",
                )
            self._mark_dead()
            if self._closed or not self._restart:
                return
            if time.monotonic() - born > STABLE_AFTER:
                attempt = 0
            while True:
                delay = RESTART_DELAYS[min(attempt, len(RESTART_DELAYS) - 1)]
                attempt += 1
                if self._closing.wait(delay):
                    return
                # The port it had, so that peers holding our address reach the new child.
                port = self._port or (_port_of(self._maddrs) if attempt == 1 else 0)
                try:
                    self._install(*self._spawn(port, timeout=30.0))
                except GossipError as e:
                    if self._closed:
                        return
                    logger.warning("gossip restart failed (%s); next try in %g s", e, delay)
                    continue
                self.restarts += 1
                logger.warning(
                    "gossip child restarted (restart %d, pid %s)", self.restarts, self.pid
                )
                break

    def _read_loop(self) -> None:
        conn = self._conn
        assert conn is not None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            try:
                kind = msg[0]
                if kind == "message":
                    self._messages.put(GossipMessage(str(msg[1]), bytes(msg[2]), str(msg[3])))
                elif kind == "connected":
                    self._deliver_reply(("connected", str(msg[1])), msg)
                elif kind == "peers":
                    self._deliver_reply(("peers",), msg)
                elif kind == "error":
                    self.errors.append(str(msg[1]))
                    logger.warning("gossip child: %s", msg[1])
                else:
                    logger.debug("gossip: unknown message %r from child", kind)
            except Exception:
                logger.exception("gossip: bad message from child")

    def _mark_dead(self) -> None:
        with self._state_lock:
            first = not self._dead
            self._dead = True
            boxes = [b for d in self._waiters.values() for b in d]
            self._waiters.clear()
        for box in boxes:
            with contextlib.suppress(queue.Full):
                box.put_nowait(_CLOSED)
        if first:
            self._messages.put(_CLOSED)


def _port_of(maddrs: Sequence[str]) -> int:
    """The TCP port of the first ``/tcp/<port>`` multiaddr; 0 if there is none."""
    for maddr in maddrs:
        if m := re.search(r"/tcp/(\d+)", maddr):
            return int(m.group(1))
    return 0
