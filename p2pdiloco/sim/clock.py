"""Simulated time: an event heap, and links that take time and count bytes."""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2pdiloco.sim.config import Profile

SMALL = 512  # bytes of a small signed message (proposal, signature, reply, certificate header)
UNREACHABLE_AFTER = 1.0  # seconds before a dial to a peer that is down gives up
COLLECT_EVERY = 3600.0  # simulated seconds between garbage collections (``Clock.run``)


class Clock:
    """Events run in time order, ties in the order they were scheduled (reproducible)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0
        self._collect_at = COLLECT_EVERY

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._seq, fn, args))

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float) -> None:
        """Every event up to ``until``, without the cyclic garbage collector's pauses: the
        events make millions of small objects and almost no cycles, so its passes over every
        live object were 38 % of a 10,000-peer run (ADR 0052). Cycles are collected once per
        simulated ``COLLECT_EVERY`` seconds instead."""
        heap = self._heap
        was_on = gc.isenabled()
        gc.disable()
        try:
            while heap and heap[0][0] <= until:
                t, _, fn, args = heapq.heappop(heap)
                if t >= self._collect_at:
                    self._collect_at = t + COLLECT_EVERY
                    if was_on:
                        gc.collect()
                self.now = t
                self.events += 1
                fn(*args)
        finally:
            if was_on:
                gc.enable()
        self.now = until


@dataclass
class Link:
    """One peer's access link: transfers through it are served one after the other."""

    profile: Profile
    up_free: float = 0.0
    down_free: float = 0.0
    sent: int = 0
    received: int = 0


@dataclass
class Links:
    by_index: dict[int, Link] = field(default_factory=dict)

    def add(self, profile: Profile) -> None:
        self.by_index.setdefault(profile.index, Link(profile))

    def transfer(self, src: int, dst: int, nbytes: int, now: float) -> float:
        """When ``nbytes`` sent by ``src`` at ``now`` have arrived at ``dst``. Each end is a
        queue served at its own rate (the sender's upload, the receiver's download), so a
        syncer's download is shared by the many learners uploading to it at once; then the
        latency. Small messages take the latency only (they do not queue behind bulk)."""
        a, b = self.by_index[src], self.by_index[dst]
        a.sent += nbytes
        b.received += nbytes
        latency = a.profile.latency + b.profile.latency
        if nbytes <= SMALL:
            return now + latency
        a.up_free = (now if now > a.up_free else a.up_free) + nbytes / a.profile.up_bps
        b.down_free = (now if now > b.down_free else b.down_free) + nbytes / b.profile.down_bps
        return (a.up_free if a.up_free > b.down_free else b.down_free) + latency

    def download(self, dst: int, nbytes: int, now: float) -> float:
        """When ``dst`` has fetched ``nbytes`` from many holders at once (chunks in parallel,
        ``sync.fetch``): its own download link is the bound."""
        b = self.by_index[dst]
        b.received += nbytes
        start = max(now, b.down_free)
        b.down_free = start + nbytes / b.profile.down_bps
        return b.down_free + b.profile.latency
