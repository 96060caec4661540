"""Who stores a run's manifest and certificate records again this heartbeat interval (sans-IO).

Bootstraps hold no state a run depends on: the run's members keep its records in the DHT. If
every member stored them every interval, a run of 10,000 peers would send 2,000 stores a second
to the same few DHT nodes; if only the creator did, the run would die with it. So each interval
a few members, drawn afresh from the live ones by a hash of (interval, peer id), store them
again: every member can compute the draw from its own membership view, the load per interval
is ``per_interval`` stores whatever the run's size, and a bootstrap restarted empty is refilled
within one interval of the members' rejoining it. Membership views may differ a little between
members; the draw then seats one more or one fewer publisher for an interval, never none while
any member sees itself among the first ``per_interval``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

# Members that store the run's records again per heartbeat interval.
REPUBLISHERS_PER_INTERVAL = 3


def interval_index(now: float, interval: float) -> int:
    """The heartbeat interval ``now`` falls in (shared by members whose clocks agree)."""
    return int(now // interval)


def _draw(index: int, peer_id: str) -> bytes:
    return hashlib.sha256(f"p2pdiloco/republish/{index}/{peer_id}".encode()).digest()


def republishes(
    me: str, live: Iterable[str], index: int, per_interval: int = REPUBLISHERS_PER_INTERVAL
) -> bool:
    """Whether ``me`` stores the run's records again in interval ``index``: it is among the
    ``per_interval`` live members (``me`` included) with the smallest draw."""
    peers = set(live) | {me}
    if len(peers) <= per_interval:
        return True
    chosen = sorted(peers, key=lambda p: _draw(index, p))[:per_interval]
    return me in chosen
