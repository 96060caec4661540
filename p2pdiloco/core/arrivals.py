"""The adaptive grace window: when a round closes with what it has, from recent arrivals.

A round closes early once ``min_quorum_fraction`` of the active learners have submitted (then
lingers); otherwise after ``grace``. That fixed grace is what a round costs whenever too few
learners arrive (learners gone, heartbeats lagging), so a run sized for its slowest islands waits
the same long minute for every such round. With ``rules.grace_min`` set, a syncer closes instead
after twice the 90th percentile of the arrival delays it saw over its last rounds (seconds from
the round opening to each accepted submission), kept within [grace_min, grace].

The close time is local, like every syncer's clock: the leader's proposal still fixes the input
set every member signs, and every timeout (leader silence, view change, stall) keeps counting the
manifest's full ``grace``, which bounds every syncer's close. Sans-IO: the service feeds it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

ROUNDS_KEPT = 8  # rounds of arrival delays the window remembers
PER_ROUND = 64  # delays kept per round (the earliest ones: enough for a 90th percentile)
FACTOR = 2.0  # close after this multiple of the 90th percentile


@dataclass
class ArrivalWindow:
    grace: float  # the manifest's grace: the upper bound
    grace_min: float | None  # the manifest's lower bound; None: adaptive grace is off
    rounds: deque[list[float]] = field(default_factory=lambda: deque(maxlen=ROUNDS_KEPT))

    def next_round(self) -> float:
        """A new round opens (later arrivals belong to it): its ``close_after``, from the
        rounds before it."""
        close = self.close_after()
        self.rounds.append([])
        return close

    def arrived(self, delay: float) -> None:
        """A submission was accepted ``delay`` seconds after its round opened."""
        if not self.rounds:
            self.rounds.append([])
        current = self.rounds[-1]
        if len(current) < PER_ROUND and math.isfinite(delay):
            current.append(max(0.0, delay))

    def close_after(self) -> float:
        """Seconds after which a round closes with what it has (``grace`` until delays exist)."""
        delays = sorted(d for r in self.rounds for d in r)
        if self.grace_min is None or not delays:
            return self.grace
        p90 = delays[min(len(delays) - 1, math.ceil(0.9 * len(delays)) - 1)]
        return min(self.grace, max(self.grace_min, FACTOR * p90))
