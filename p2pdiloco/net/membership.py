"""Who is in a run right now: a sans-IO table fed with heartbeat envelopes.

The node feeds it what it reads from the DHT and what arrives by gossip; both paths carry the
same signed heartbeats, so the table converges through either one alone. It never does I/O and
takes ``now`` as an argument, so the node, the tests and a simulator share it.

Rules for one heartbeat envelope (already signature-checked by ``open_envelope``):
- identical bytes to one already accepted: a duplicate (the other path), ignored silently;
- older than the newest accepted from that peer: a stale copy, ignored silently and counted in
  ``stale``. The DHT and gossip deliver one peer's heartbeats in any order (a DHT replica lags
  the gossiped heartbeat by an interval), so this is normal operation, and a replayed old
  heartbeat can do no harm: the table keeps the newest;
- as old as the newest but other bytes: two heartbeats signed for one instant, rejected;
- otherwise accepted, and the peer is live until ``ts + ttl``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from p2pdiloco.protocol.records import Heartbeat, parse_heartbeat
from p2pdiloco.protocol.signing import Envelope, InvalidRecord


@dataclass
class PeerView:
    """The freshest heartbeat of one peer and how we learned it."""

    peer_id: str
    heartbeat: Heartbeat
    ts: float
    via: str  # "dht" or "gossip": the path that delivered the freshest heartbeat
    seen_via: set[str] = field(default_factory=set)


@dataclass
class Membership:
    """Live peers of one run (or of the bootstrap set, with run id "")."""

    run_id: str
    ttl: float
    peers: dict[str, PeerView] = field(default_factory=dict)
    _digests: dict[str, bytes] = field(default_factory=dict)
    rejected: int = 0
    stale: int = 0  # older copies ignored (not rejections: see the module docstring)

    def ingest(self, env: Envelope, *, via: str) -> bool:
        """Take one heartbeat; True if it changed the table.

        Raises InvalidRecord for a heartbeat of another run, a body that does not parse or
        does not match its signer, or a second heartbeat with the newest one's timestamp.
        """
        if env.kind != "heartbeat" or env.run != self.run_id:
            raise InvalidRecord(
                f"expected a heartbeat of run {self.run_id[:12] or '-'}, got {env.kind} of "
                f"run {env.run[:12] or '-'}",
                signer=env.signer,
            )
        digest = hashlib.sha256(env.raw).digest()
        known = self.peers.get(env.signer)
        if known is not None:
            if self._digests.get(env.signer) == digest:
                known.seen_via.add(via)
                return False
            if env.ts < known.ts:
                self.stale += 1
                return False
            if env.ts == known.ts:
                self.rejected += 1
                raise InvalidRecord(
                    f"conflicting heartbeat (other bytes for ts {env.ts:.3f})", signer=env.signer
                )
        hb = parse_heartbeat(env)
        self.peers[env.signer] = PeerView(env.signer, hb, env.ts, via, {via})
        self._digests[env.signer] = digest
        return True

    def expire(self, now: float) -> list[str]:
        """Drop peers whose freshest heartbeat is older than the TTL; return their ids."""
        gone = [p for p, v in self.peers.items() if v.ts + self.ttl < now]
        for p in gone:
            del self.peers[p]
            self._digests.pop(p, None)
        return gone

    def live(self, now: float) -> list[PeerView]:
        """Peers alive at ``now``, sorted by peer id."""
        return sorted(
            (v for v in self.peers.values() if v.ts + self.ttl >= now), key=lambda v: v.peer_id
        )

    def ingest_many(self, envs: Iterable[tuple[Envelope, str]]) -> list[InvalidRecord]:
        """Ingest several; collect (rather than raise) the rejections for logging."""
        errors = []
        for env, via in envs:
            try:
                self.ingest(env, via=via)
            except InvalidRecord as e:
                errors.append(e)
        return errors
