"""Parent side of the gossip plane: drives a py-libp2p gossipsub host in a child process.

hivemind and py-libp2p cannot share an interpreter (ADR 0001), so the gossipsub host runs in
a child started with the ``spawn`` method (:mod:`p2pdiloco.net.gossip_host`), and this module
talks to it over a pipe. It imports neither stack: stdlib and ``multiprocessing`` only.

Gossip is an accelerator (everything gossiped is also in the DHT): when the child dies,
:attr:`GossipProcess.alive` turns False, :meth:`~GossipProcess.get` returns None and sends
raise :class:`GossipError`; the parent keeps running and may start a new process.

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
import multiprocessing as mp
import queue
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

# Largest payload one gossip message may carry; larger ones are refused on publish and
# dropped on receipt (bulk data goes over streams, not gossip).
MAX_MESSAGE_BYTES = 256 * 1024

_CLOSED = object()  # wakes get() once the child is gone
_main_lock = threading.Lock()


class GossipError(Exception):
    """The gossip child is not running, did not start, or refused a request."""


class GossipMessage(NamedTuple):
    topic: str
    data: bytes
    from_peer: str  # base58 peer id of the original publisher


def _child_entry(
    conn: Connection, seed: bytes, listen_host: str, port: int, topics: list[str]
) -> None:
    # Runs in the spawned child. The import happens here, never in the parent.
    if "hivemind" in sys.modules:  # py-libp2p cannot load next to it (ADR 0001)
        raise RuntimeError("hivemind was imported into the gossip child; it must not be")
    from p2pdiloco.net.gossip_host import run_child

    run_child(conn, seed, listen_host, port, topics)


@contextlib.contextmanager
def _no_main_reimport() -> Iterator[None]:
    """Keep ``spawn`` from re-running the parent's ``__main__`` in the child.

    ``spawn`` re-imports the parent's main module in the child (by path, or by name for
    ``python -m``). For a console script such as ``p2pdiloco`` that would pull the whole CLI,
    hivemind included, into the gossip child, where hivemind must never be imported. The
    child needs nothing from ``__main__`` (its target lives in this module), so the main
    module's ``__spec__``/``__file__`` are hidden for the instant of ``Process.start()``.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    with _main_lock:
        missing = object()
        saved = {k: main.__dict__.get(k, missing) for k in ("__spec__", "__file__")}
        try:
            main.__spec__ = None
            main.__dict__.pop("__file__", None)
            yield
        finally:
            for k, v in saved.items():
                if v is missing:
                    main.__dict__.pop(k, None)
                else:
                    main.__dict__[k] = v


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
    ) -> None:
        if len(seed) != 32:
            raise ValueError(f"seed must be 32 bytes, got {len(seed)}")
        if isinstance(topics, str):
            raise TypeError("topics must be a sequence of strings, not a string")
        self._seed = bytes(seed)
        self._topics = list(topics)
        self._listen_host = listen_host
        self._port = int(port)
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

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Spawn the child and wait until its host listens; GossipError otherwise."""
        with self._state_lock:
            if self._started:
                raise GossipError("gossip process already started")
            self._started = True
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_child_entry,
            args=(child_conn, self._seed, self._listen_host, self._port, self._topics),
            name="p2pdiloco-gossip",
            daemon=True,
        )
        with _no_main_reimport():
            proc.start()
        child_conn.close()  # so that the child's death reads as EOF here
        self._proc, self._conn = proc, parent_conn
        deadline = time.monotonic() + timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise GossipError(f"gossip child not ready within {timeout:g} s")
                ready = wait([parent_conn, proc.sentinel], remaining)
                if parent_conn in ready:
                    try:
                        msg = parent_conn.recv()
                    except (EOFError, OSError):
                        proc.join(timeout=5.0)
                        raise GossipError(
                            f"gossip child exited during startup (exit code {proc.exitcode})"
                        ) from None
                    if msg[0] == "ready":
                        self._peer_id, self._maddrs = str(msg[1]), [str(a) for a in msg[2]]
                        break
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
            self._dead = True
            self._stop_child(timeout=1.0)
            parent_conn.close()
            raise
        self._reader = threading.Thread(
            target=self._read_loop, name="p2pdiloco-gossip-reader", daemon=True
        )
        self._reader.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child (politely, then by force); idempotent, never raises for a dead child."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        if self._proc is None:
            return
        with contextlib.suppress(Exception):
            self._send(("close",), check=False)
        self._stop_child(timeout)
        if self._reader is not None:
            self._reader.join(timeout=max(timeout, 1.0))
        self._mark_dead()
        if self._conn is not None:
            self._conn.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def _stop_child(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        proc.join(timeout)
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)

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
        self._send(("subscribe", str(topic)))

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
            self._messages.put(_CLOSED)  # wake the next reader too
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

    def _read_loop(self) -> None:
        conn = self._conn
        assert conn is not None
        try:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break
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
        finally:
            proc = self._proc
            if not self._closed and proc is not None:
                wait([proc.sentinel], 1.0)  # let it be reaped, for the exit code
                logger.warning(
                    "gossip child is gone (exit code %s); gossip disabled", proc.exitcode
                )
            self._mark_dead()

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
