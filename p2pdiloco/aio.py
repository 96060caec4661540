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


class _CancelledStreamCallback(logging.Filter):
    """Drops asyncio's "Exception in callback" for a stream server's connection task that was
    cancelled (see :func:`quiet_cancelled_stream_callbacks`); passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        text = record.getMessage()
        if (
            isinstance(exc, asyncio.CancelledError)
            and text.startswith("Exception in callback")
            and "connection_made" in text
        ):
            log.debug("a cancelled daemon stream handler ended: %s", text[:200])
            return False
        return True


def quiet_cancelled_stream_callbacks() -> None:
    """Keep (once per process, and in processes forked after it) one Python 3.11 asyncio quirk
    out of the logs: a stream server's per-connection task cancelled at shutdown makes the
    done-callback of ``StreamReaderProtocol`` call ``task.exception()``, which raises
    CancelledError, and the loop logs it as "Exception in callback ... Traceback" (3.12 checks
    ``task.cancelled()`` first). hivemind's daemon bindings serve inbound streams that way, so a
    node or DHT process stopping with a stream open printed a traceback (a fresh-clone CI failed
    on "Traceback" in a stopped node's log). Nothing else of the loop's errors is dropped."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _CancelledStreamCallback) for f in logger.filters):
        logger.addFilter(_CancelledStreamCallback())


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
