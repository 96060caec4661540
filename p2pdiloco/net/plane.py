"""What the runtime needs of membership, the DHT and gossip: the ``Plane`` interface.

``node.Node`` is the real plane (signed heartbeats in the hivemind DHT and on gossipsub). The
``MemoryPlane`` here shares a ``MemoryDirectory`` between the nodes of one process, for the
in-memory driver tests and simulations. A plane's methods are called on the runtime's loop
only; ``tick`` may do blocking work in a worker thread but changes the plane's state on the
loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from p2pdiloco.protocol.certificates import Certificate


@dataclass(frozen=True)
class Presence:
    """What this node announces in its heartbeat."""

    version: int
    roles: tuple[str, ...]
    throughput_tps: float
    stalled_s: float = 0.0  # seconds waited for the next certificate, once stalled; else 0


class Plane(Protocol):
    me: str

    def peers_holding(self, version: int) -> list[str]:
        """Live members (not this node) that announce ``version`` or newer."""
        ...

    def live_learners(self) -> list[str]:
        """Live learners of the run, this node included."""
        ...

    async def tick(self, presence: Presence) -> list[bytes]:
        """Announce ``presence``, refresh membership; certificate bytes heard meanwhile."""
        ...

    async def publish_certificate(self, cert: Certificate) -> None: ...

    async def read_certificates(self) -> list[bytes]:
        """Certificates stored for the run (unverified)."""
        ...


@dataclass
class MemoryDirectory:
    presence: dict[str, Presence] = field(default_factory=dict)
    certs: dict[str, bytes] = field(default_factory=dict)  # newest certificate by publisher
    inboxes: dict[str, list[bytes]] = field(default_factory=dict)  # "gossip" not yet ticked
    down: set[str] = field(default_factory=set)
    # Largest certificate "gossip" carries (net.gossip_limits.MAX_MESSAGE_BYTES on the real plane);
    # None: any. Larger ones are found as on the real plane: ``cert`` from announcing peers.
    gossip_max: int | None = None

    def plane(self, me: str) -> MemoryPlane:
        self.inboxes.setdefault(me, [])
        return MemoryPlane(self, me)


class MemoryPlane:
    def __init__(self, directory: MemoryDirectory, me: str) -> None:
        self.dir = directory
        self.me = me

    def _live(self) -> dict[str, Presence]:
        return {p: v for p, v in self.dir.presence.items() if p not in self.dir.down}

    def peers_holding(self, version: int) -> list[str]:
        return sorted(p for p, v in self._live().items() if p != self.me and v.version >= version)

    def live_learners(self) -> list[str]:
        others = [p for p, v in self._live().items() if p != self.me and "learner" in v.roles]
        return [self.me, *others]

    async def tick(self, presence: Presence) -> list[bytes]:
        if self.me in self.dir.down:
            return []
        self.dir.presence[self.me] = presence
        heard, self.dir.inboxes[self.me] = self.dir.inboxes.get(self.me, []), []
        return heard

    async def publish_certificate(self, cert: Certificate) -> None:
        if self.me in self.dir.down:
            return
        self.dir.certs[self.me] = cert.raw
        if self.dir.gossip_max is not None and len(cert.raw) > self.dir.gossip_max:
            return
        for peer, inbox in self.dir.inboxes.items():
            if peer != self.me and len(inbox) < 64:
                inbox.append(cert.raw)

    async def read_certificates(self) -> list[bytes]:
        return list(self.dir.certs.values())
