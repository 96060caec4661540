"""What the network commands share: bootstrap resolution and a short-lived DHT client."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from p2pdiloco.config import resolve_bootstrap
from p2pdiloco.errors import UserError
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.protocol.identity import Identity


def bootstrap_addrs(flags: list[str] | None) -> tuple[list[str], str]:
    addrs, source = resolve_bootstrap(flags)
    if not addrs:
        raise UserError(
            "no bootstrap server configured: pass --bootstrap ADDR, set P2PDILOCO_BOOTSTRAP, "
            "or add bootstrap = [...] to ~/.config/p2pdiloco/config.toml"
        )
    return addrs, source


@contextlib.contextmanager
def dht_client(flags: list[str] | None) -> Iterator[DHTPlane]:
    """A client-mode DHT node with a throw-away key (it serves nothing and signs nothing)."""
    addrs, _ = bootstrap_addrs(flags)
    with DHTPlane(Identity.generate(), initial_peers=addrs, client_mode=True) as dht:
        yield dht
