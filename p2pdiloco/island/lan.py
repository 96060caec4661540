"""A LAN island in ``join --island NAME --lan-island``: rank 0 announces itself in the DHT, and
the other hosts of the LAN that pass the same name find it and serve as its members."""

from __future__ import annotations

import logging
import threading
from typing import Any

from p2pdiloco.net import keys
from p2pdiloco.net.islands import find_island, publish_island
from p2pdiloco.protocol.records import IslandRendezvous

log = logging.getLogger(__name__)


class Announcer:
    """Re-publishes rank 0's rendezvous every heartbeat interval until ``stop``."""

    def __init__(self, node: Any, name: str, learner: Any) -> None:
        self.node, self.name, self.learner = node, name, learner
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="island-announce")

    @property
    def address(self) -> str:
        return str(self.learner.island.address)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)

    def _run(self) -> None:
        island = self.learner.island
        while True:
            rdv = IslandRendezvous(
                peer_id=self.node.identity.peer_id,
                island=self.name,
                store=island.address,
                backend=island.spec.backend,
                ranks=max(1, island.world),
            )
            try:
                publish_island(self.node.dht, self.node.identity, self.node.run.run_id, rdv)
            except Exception as e:  # the next interval tries again
                log.info("island rendezvous not published: %s", e)
            if self._done.wait(keys.HEARTBEAT_INTERVAL):
                return


def find_leader(node: Any, name: str) -> IslandRendezvous | None:
    """Another host's live rendezvous for island ``name`` in this node's run, if any."""
    return find_island(node.dht, node.run.run_id, name, exclude=node.identity.peer_id)


def serve_as_member(
    rdv: IslandRendezvous, secret: bytes, device: str, stop: threading.Event
) -> int:
    """Serve rank 0 of ``rdv`` until it stops us, goes away, or ``stop`` is set; ``secret``
    is the island's (``join --island-secret``), without which rank 0 refuses this host."""
    import torch

    from p2pdiloco.island.member import run_member
    from p2pdiloco.train.device import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return run_member(rdv.store, secret, device=dev, stop=stop.is_set)
