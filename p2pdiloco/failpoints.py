"""Faults injected on purpose, for tests on real processes.

``P2PDILOCO_FAILPOINTS="serve_fetch=2"`` makes this node refuse the first two submission fetches
a fellow syncer asks of it, as a dropped stream would. A failpoint only makes a node fail where a
network can fail it; it never changes a byte that is signed or certified, so it cannot change
consensus. Unset (every real deployment), ``hit`` is one dict lookup and always False.

Known failpoints: ``serve_fetch`` (the ``fetch`` RPC of the sync service).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

ENV = "P2PDILOCO_FAILPOINTS"
KNOWN = frozenset({"serve_fetch"})

_lock = threading.Lock()
_counts: dict[str, int] | None = None  # read from the environment on first use (after a fork)


def _parse(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, count = item.partition("=")
        if name not in KNOWN or not count.isdigit():
            log.warning("%s: ignoring %r (known: %s, as name=count)", ENV, item, ", ".join(KNOWN))
            continue
        out[name] = int(count)
    return out


def hit(name: str) -> bool:
    """True (and one fewer left) while failpoint ``name`` has failures left."""
    global _counts
    with _lock:
        if _counts is None:
            _counts = _parse(os.environ.get(ENV, ""))
        left = _counts.get(name, 0)
        if left <= 0:
            return False
        _counts[name] = left - 1
    log.warning("failpoint %s: failing here on purpose (%d more)", name, left - 1)
    return True
