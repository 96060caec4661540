"""Which fellows of a round a committee member could not reach, and when (ADR 0038, ADR 0041).

The driver reports every dial to a fellow that failed to connect (``SyncerRound.on_unreachable``)
and every message a fellow sent or took (``on_reached``). A fellow stays "gone" from its first
failure until it is heard from again. Two conclusions follow, each a reason to vote the view
away before ``view_timeout``:

- the attempt's leader is gone: nothing will be proposed (ADR 0038);
- more than k − q fellows are gone and have not signed this member's state: the members left
  cannot reach the quorum, so the view can only time out (ADR 0041). Their votes hand the
  version on, locked on what they signed (``protocol.view_change``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


@dataclass
class Reach:
    gone: dict[str, float] = field(default_factory=dict)  # fellow → first failed dial

    def lost(self, peer: str, now: float) -> None:
        self.gone.setdefault(peer, now)

    def heard(self, peer: str) -> None:
        self.gone.pop(peer, None)

    def quorum_lost_at(
        self, committee: Sequence[str], quorum: int, signed: Collection[str]
    ) -> float | None:
        """When the fellows gone (and not among ``signed``, whose signatures count whatever
        became of them) became more than k − q, so that at most q − 1 members can still sign:
        the time of the failure that made them so many; None while the quorum is in reach."""
        times = sorted(t for p, t in self.gone.items() if p in committee and p not in signed)
        need = len(committee) - quorum + 1
        return times[need - 1] if need >= 1 and len(times) >= need else None
