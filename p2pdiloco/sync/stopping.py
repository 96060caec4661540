"""A merge's batch loops abandoned when their node stops.

The work scores and the held-out eval of a merge run batch by batch in the loop's worker
thread, which ``asyncio.run`` joins at exit: without a way out a clean stop waited them out
(10-21 s a stop on a CPU README run; minutes on a large model). The node's ``close`` sets the
flag; the loop under way raises :class:`MergeStopped` before its next batch (``check`` is what
``train.inner.row_losses`` and ``evaluate`` call), and so does every later one.
"""

from __future__ import annotations

import threading


class MergeStopped(Exception):
    """The node is stopping: the merge's work under way is abandoned."""


class StopFlag:
    """Set once, from any thread, when the node stops; ``check`` raises from then on."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def stop(self) -> None:
        self._event.set()

    def check(self) -> None:
        if self._event.is_set():
            raise MergeStopped("the node is stopping")
