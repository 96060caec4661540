"""A private asyncio loop in a thread, holding a replica of the DHT's hivemind P2P client.

hivemind's P2P API is asyncio; the node's control loop is plain threads and blocking calls. The
bridge runs coroutines on its own loop and waits for them with a timeout, so P2P streams (dial
back today, bulk transfers later) can be used from anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import hivemind
from hivemind.p2p import P2P

T = TypeVar("T")


class P2PBridge:
    """Owns an event loop thread and ``dht.replicate_p2p()``; close() stops both."""

    def __init__(self, dht: hivemind.DHT, timeout: float = 30.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="p2p")
        self._thread.start()
        self.p2p: P2P = self.run(dht.replicate_p2p(), timeout)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the bridge loop; raise TimeoutError after ``timeout`` seconds."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

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
