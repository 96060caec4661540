"""Containers whose size peers cannot grow without bound.

Anything a syncer keeps per peer or per submission must stay bounded whatever the network
sends: ``ReplayGuard`` remembers recent submission digests to refuse replays, ``BoundedLog``
keeps the latest entries of a log (rejections, say) and counts the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class ReplayGuard:
    """Submission digests seen recently, by base version, to refuse a replayed submission.

    Versions from ``current − window`` to ``current + lookahead`` are remembered; ``advance``
    forgets older ones. Forgetting is safe because a syncer refuses any submission whose base
    version is older than v − staleness as STALE (``SyncerRound``), and the window is
    ``staleness + 2`` (``for_staleness``), so a replay that is no longer remembered is refused
    by its version anyway. For the same reason ``add`` does not remember a digest whose base
    version is outside the window (older: stale; newer: refused as BASE_TOO_NEW, so a later
    copy is not a replay of anything accepted) and reports it as new: callers must screen the
    version, as the round does.

    Each version holds at most ``per_version_cap`` digests; beyond that the oldest is forgotten
    first. This is a backstop against a flood within one version: an evicted digest sent again
    is still refused by the round holding it (DUPLICATE) while that round is open. Memory is at
    most (window + 1 + lookahead) × per_version_cap digests.
    """

    def __init__(
        self,
        window: int,
        per_version_cap: int = 65536,
        lookahead: int = 2,
        current_version: int = 0,
    ) -> None:
        if window < 0 or lookahead < 0 or per_version_cap < 1:
            raise ValueError("window and lookahead must be ≥ 0, per_version_cap ≥ 1")
        self.window = window
        self.lookahead = lookahead
        self.per_version_cap = per_version_cap
        self.current = current_version
        self._by_version: dict[int, dict[str, None]] = {}  # insertion-ordered digest sets
        self.evicted = 0  # digests forgotten by the per-version cap (not by advancing)

    @classmethod
    def for_staleness(cls, staleness: int, **kw: int) -> ReplayGuard:
        """The guard for a run whose rounds accept bases down to v − ``staleness``."""
        return cls(window=staleness + 2, **kw)

    def add(self, digest: str, base_version: int) -> bool:
        """True if ``digest`` is new (and now remembered), False if it is a replay."""
        if not self.current - self.window <= base_version <= self.current + self.lookahead:
            return True
        seen = self._by_version.setdefault(base_version, {})
        if digest in seen:
            return False
        seen[digest] = None
        if len(seen) > self.per_version_cap:
            del seen[next(iter(seen))]
            self.evicted += 1
        return True

    def __contains__(self, item: tuple[str, int]) -> bool:
        digest, base_version = item
        return digest in self._by_version.get(base_version, {})

    def advance(self, current_version: int) -> None:
        """The certified version is now ``current_version``: forget versions below the window."""
        self.current = max(self.current, current_version)
        oldest = self.current - self.window
        for v in [v for v in self._by_version if v < oldest]:
            del self._by_version[v]

    def __len__(self) -> int:
        return sum(len(s) for s in self._by_version.values())

    @property
    def versions(self) -> int:
        """Number of base versions currently remembered."""
        return len(self._by_version)


class BoundedLog(Generic[T]):
    """An append-only log that keeps the latest ``maxlen`` entries and counts all of them."""

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be ≥ 1")
        self._items: deque[T] = deque(maxlen=maxlen)
        self.total = 0  # entries ever appended, kept or not

    @property
    def maxlen(self) -> int:
        assert self._items.maxlen is not None
        return self._items.maxlen

    @property
    def forgotten(self) -> int:
        """Entries appended but no longer kept."""
        return self.total - len(self._items)

    def append(self, item: T) -> None:
        self._items.append(item)
        self.total += 1

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def latest(self, n: int) -> list[T]:
        """The last ``n`` entries kept, oldest first."""
        if n <= 0:
            return []
        return list(self._items)[-n:]
