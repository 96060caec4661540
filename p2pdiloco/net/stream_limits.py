"""Admission of inbound sync streams: how many at once, and how many announced bytes in flight.

Without a cap, 60 concurrent submit streams each announcing a 5 MB payload raised a node's
memory by 434 MB. A ``StreamBudget`` is consulted before anything beyond a request's control
frame is read: a stream over its peer's or the node's stream count, or a frame whose announced
size would take its peer or the node over the in-flight byte budget, is answered ``busy``
(retryable) and closed unread. Counts are released when the request has been answered. Owned by
the event loop that serves streams (not thread-safe).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


class Busy(Exception):
    """Over a cap: the stream is answered with code ``busy`` (retry later) and closed unread."""


@dataclass(frozen=True)
class StreamLimits:
    """Caps on inbound sync streams. Tuning: ``max_streams_per_peer`` must exceed what one
    honest peer opens at once (a state or update download asks 4 chunks in parallel from each
    peer)."""

    max_streams_per_peer: int = 8
    max_streams: int = 64
    max_bytes_per_peer: int = 64 * MIB  # announced request bytes being read, per peer
    max_bytes: int = 256 * MIB  # announced request bytes being read, all peers together

    @classmethod
    def for_request(cls, largest: int) -> StreamLimits:
        """Limits for a node whose largest legitimate request is ``largest`` bytes: a peer may
        have two such requests in flight, the node four (at least 64 MiB in all)."""
        return cls(max_bytes_per_peer=2 * largest + MIB, max_bytes=max(4 * largest, 64 * MIB))


class StreamBudget:
    def __init__(self, limits: StreamLimits) -> None:
        self.limits = limits
        self.streams: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.total_streams = 0
        self.total_bytes = 0

    def open(self, peer: str) -> Ticket:
        """Admit one stream from ``peer``; Busy if it or the node is at its cap."""
        lim = self.limits
        if self.streams.get(peer, 0) >= lim.max_streams_per_peer:
            raise Busy(f"over {lim.max_streams_per_peer} streams from one peer")
        if self.total_streams >= lim.max_streams:
            raise Busy(f"over {lim.max_streams} streams in all")
        self.streams[peer] = self.streams.get(peer, 0) + 1
        self.total_streams += 1
        return Ticket(self, peer)

    def _reserve(self, peer: str, n: int) -> None:
        lim = self.limits
        if self.bytes.get(peer, 0) + n > lim.max_bytes_per_peer:
            raise Busy(f"over {lim.max_bytes_per_peer} bytes in flight from one peer")
        if self.total_bytes + n > lim.max_bytes:
            raise Busy(f"over {lim.max_bytes} bytes in flight in all")
        self.bytes[peer] = self.bytes.get(peer, 0) + n
        self.total_bytes += n

    def _release(self, peer: str, n: int) -> None:
        self.total_streams -= 1
        self.total_bytes -= n
        left = self.bytes.get(peer, 0) - n
        streams = self.streams.get(peer, 0) - 1
        if streams <= 0:
            self.streams.pop(peer, None)
            self.bytes.pop(peer, None)
        else:
            self.streams[peer], self.bytes[peer] = streams, left


class Ticket:
    """One admitted stream; ``reserve`` each announced frame before reading it, ``close`` once
    (idempotent) when the request is answered."""

    def __init__(self, budget: StreamBudget, peer: str) -> None:
        self._budget = budget
        self._peer = peer
        self._held = 0
        self._open = True

    def reserve(self, n: int) -> None:
        """Count ``n`` announced bytes against the budget; Busy if over."""
        self._budget._reserve(self._peer, n)
        self._held += n

    def close(self) -> None:
        if self._open:
            self._open = False
            self._budget._release(self._peer, self._held)
