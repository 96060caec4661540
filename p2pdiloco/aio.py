"""asyncio helpers shared by the node runtime and the sync service: ending tasks for sure.

On Python 3.11 ``asyncio.wait_for`` can swallow a cancellation that arrives as the awaited call
completes (fixed in 3.12, gh-86296): the task then carries on, and a ``gather`` of cancelled
tasks waits for it forever. Two in-memory runtime tests hung that way for 300 s in full runs,
in ``close()`` of one node while its peers kept certifying. So a task that is still running
after a cancel is cancelled again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

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
