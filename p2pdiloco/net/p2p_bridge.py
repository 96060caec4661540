"""The node's asyncio loop in a thread, holding a replica of the DHT's hivemind P2P client.

This loop is the node runtime's loop (``runtime.node_runtime``): everything network-facing
lives on it. The main thread starts and stops things through ``run``, which waits for a
coroutine with a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import hivemind
from hivemind.p2p import P2P

from p2pdiloco.aio import quiet_cancelled_stream_callbacks, quiet_stream_gc

T = TypeVar("T")


class P2PBridge:
    """Owns an event loop thread and ``dht.replicate_p2p()``; close() stops both."""

    def __init__(self, dht: hivemind.DHT, timeout: float = 30.0) -> None:
        quiet_stream_gc()  # hivemind's client leaks a stream per cancelled daemon call
        quiet_cancelled_stream_callbacks()
        self._loop = asyncio.new_event_loop()
        self.loop = self._loop  # the node runtime's loop: every network-facing state lives on it
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="p2p")
        self._thread.start()
        self.p2p: P2P = self.run(dht.replicate_p2p(), timeout)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the bridge loop; raise TimeoutError after ``timeout`` seconds. A wait
        that ends without its result (the timeout, or Ctrl-C interrupting a start) cancels
        ``coro``: nothing goes on on the loop for a caller that left."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def close(self) -> None:
        """Shut the replica's daemon client down, cancel what still runs, stop the loop."""
        if not self._loop.is_running():
            return
        with contextlib.suppress(Exception):
            self.run(self.p2p.shutdown(), 5)
        with contextlib.suppress(Exception):
            self.run(self._cancel_all(), 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    @staticmethod
    async def _cancel_all() -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
