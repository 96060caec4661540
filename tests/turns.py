"""One solo test at a time across xdist workers, handed over in turn (ADR 0015).

Solo tests (``pytest.mark.solo``) start training networks (a bootstrap and several nodes, each
with its p2pd daemon, DHT process and gossip child) or run whole committees in one process.
Two of them at once on 2 CPU cores slow each other's rounds: a CI run whose last slow tests
ran on both workers stalled a round for 300 s, and the next bootstrap did not start within
60 s. ``--dist worksteal``
gives one worker the solo tests, but the other steals from the end of that worker's queue once
its own is empty, and then the end of the queue is solo tests. A turn is an ``flock`` on a
file shared by the workers of one run; a worker that just had a turn lets a waiting one go
first, so neither waits more than one test.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

HANDOVER_S = 30.0  # a waiter takes the turn within a poll; a stale marker is ignored after
GIVE_UP_S = 900.0  # never hang a run on a turn: after this, run anyway (and say so)
POLL_S = 0.05


class Turns:
    """One per worker process. The lock file is opened once and never closed: every turn locks
    the same open file description, so a process cannot block on its own lock, and nothing
    blocks in the kernel (non-blocking attempts, polled)."""

    def __init__(self, lock: Path, me: str) -> None:
        self.lock = lock
        self.me = me
        self._had_turn = False
        self._fd: int | None = None

    def _marker(self) -> Path:
        return self.lock.with_name(f"{self.lock.name}.wait-{self.me}")

    def _others_waiting(self) -> bool:
        mine = self._marker().name
        prefix = self.lock.name + ".wait-"
        return any(p.name.startswith(prefix) and p.name != mine for p in self.lock.parent.iterdir())

    def _try_lock(self) -> bool:
        if self._fd is None:
            self._fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    @contextlib.contextmanager
    def turn(self) -> Iterator[float]:
        """Hold the turn for the block; yields the seconds spent waiting for it."""
        started = time.monotonic()
        pause = threading.Event()
        if self._had_turn:
            while self._others_waiting() and time.monotonic() < started + HANDOVER_S:
                pause.wait(POLL_S)
        marker = self._marker()
        marker.touch()
        try:
            while not self._try_lock():
                if time.monotonic() > started + GIVE_UP_S:
                    print(
                        f"tests/turns.py: {self.me} ran without a turn after {GIVE_UP_S:.0f} s",
                        file=sys.stderr,
                    )
                    break
                pause.wait(POLL_S)
        finally:
            marker.unlink(missing_ok=True)
        try:
            yield time.monotonic() - started
        finally:
            assert self._fd is not None
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._had_turn = True
