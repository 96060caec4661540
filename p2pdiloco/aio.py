"""asyncio helpers shared by the node runtime and the sync service: ending tasks for sure, and
keeping hivemind's leaked daemon streams out of the logs.

On Python 3.11 ``asyncio.wait_for`` can swallow a cancellation that arrives as the awaited call
completes (fixed in 3.12, gh-86296): the task then carries on, and a ``gather`` of cancelled
tasks waits for it forever. Two in-memory runtime tests hung that way for 300 s in full runs,
in ``close()`` of one node while its peers kept certifying. So a task that is still running
after a cancel is cancelled again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], what: str, pause: float = 0.5, tries: int = 20
) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again every ``pause`` s any
    that is still running; after ``tries`` rounds, log the stragglers and return."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(tries):
        if not pending:
            return
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=pause)
    if pending:
        names = ", ".join(sorted(t.get_name() for t in pending))
        log.warning("%s: %d task(s) did not end when cancelled: %s", what, len(pending), names)


def quiet_stream_gc() -> None:
    """Install (once per process) an unraisable-exception hook that turns the error of a leaked
    ``asyncio.StreamWriter`` being collected into one debug line.

    hivemind's daemon client opens a unix-socket stream per call and does not close it when the
    call is cancelled (our ``wait_for`` around a dial to a dead peer). When such a writer is
    collected after its transport went away, Python 3.11's ``StreamWriter.__del__`` fails in the
    ``repr`` of its own warning and prints "Exception ignored in ... Traceback" into the node's
    log: nothing is wrong with the node, and nothing else would be dropped. Every other
    unraisable exception goes to the default hook.
    """
    if getattr(sys.unraisablehook, "_p2pdiloco", False):
        return
    default = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        where = getattr(unraisable.object, "__qualname__", "")
        if where == "StreamWriter.__del__":
            log.debug("a leaked daemon stream was collected: %s", unraisable.exc_value)
            return
        default(unraisable)

    hook._p2pdiloco = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking DHT/gossip I/O in a daemon thread and await it. Not the loop's executor:
    a call stuck on a DHT that is shutting down must not hold the process at exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the awaiting coroutine
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, None, e)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=work, daemon=True, name="dht-io").start()
    return await fut
