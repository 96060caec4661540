"""Stop long-running commands cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import threading


def stop_event() -> threading.Event:
    """An event set by the first SIGINT or SIGTERM; a second SIGINT exits at once."""
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise SystemExit(130)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop
