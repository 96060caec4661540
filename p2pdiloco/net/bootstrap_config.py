"""A bootstrap server's settings, apart from the server: ``p2pdiloco bootstrap`` reads its
defaults and refuses a taken port before hivemind and torch load (``net.bootstrap``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from p2pdiloco.net import keys

# A bootstrap server's HTTP port unless ``--http-port`` says otherwise; ``status`` looks for the
# server it is given there first.
DEFAULT_HTTP_PORT = 8080


@dataclass
class BootstrapConfig:
    """Settings of one bootstrap server (flags map one-to-one onto these)."""

    host: str = "0.0.0.0"  # interface the DHT and gossip hosts listen on
    port: int = 31337  # DHT (p2pd) TCP port; gossip listens on port + 1 (0: both random)
    http_host: str = "0.0.0.0"
    http_port: int = DEFAULT_HTTP_PORT  # health/state/metrics; 0 picks a free port
    announce: list[str] = field(default_factory=list)  # public multiaddrs to advertise
    identity: Path | None = None  # key file; default: bootstrap.key beside a node's identity.key
    initial_peers: list[str] = field(default_factory=list)  # other bootstraps to peer with
    refresh_interval: float = keys.HEARTBEAT_INTERVAL  # own heartbeat and state poll period
