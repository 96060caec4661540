"""LAN islands in the DHT: rank 0 publishes a signed rendezvous record, the other hosts of the
island read it to find rank 0's store (``join --island NAME --lan-island``, ADR 0020)."""

from __future__ import annotations

import logging
import time

from p2pdiloco.net import keys
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import ISLAND_KIND, IslandRendezvous, parse_island
from p2pdiloco.protocol.signing import InvalidRecord, seal

log = logging.getLogger(__name__)

ISLAND_TTL = keys.HEARTBEAT_TTL


def publish_island(dht: DHTPlane, identity: Identity, run_id: str, rdv: IslandRendezvous) -> bool:
    """Store (refresh) this rank 0's rendezvous; False if no DHT peer took it."""
    raw = seal(identity, ISLAND_KIND, run_id, rdv.model_dump(mode="json"))
    return dht.store(keys.run_islands_key(run_id), identity.peer_id, raw, ISLAND_TTL)


def find_island(
    dht: DHTPlane, run_id: str, name: str, *, exclude: str = "", now: float | None = None
) -> IslandRendezvous | None:
    """The freshest live rendezvous of island ``name`` in ``run_id`` (not ``exclude``'s)."""
    now = time.time() if now is None else now
    found: list[tuple[float, IslandRendezvous]] = []
    for rec in dht.read(keys.run_islands_key(run_id), kind=ISLAND_KIND, run_id=run_id):
        try:
            rdv = parse_island(rec.envelope)
        except InvalidRecord as e:
            log.warning("dropped island record from %s: %s", rec.envelope.signer, e)
            continue
        fresh = now - rec.envelope.ts <= ISLAND_TTL
        if rdv.island == name and rdv.peer_id != exclude and fresh:
            found.append((rec.envelope.ts, rdv))
    return max(found, key=lambda f: f[0])[1] if found else None
