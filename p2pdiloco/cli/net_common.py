"""What the network commands share: bootstrap resolution and a short-lived DHT client."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from p2pdiloco.config import resolve_bootstrap
from p2pdiloco.errors import ConfigError, UserError
from p2pdiloco.protocol.identity import Identity

if TYPE_CHECKING:  # hivemind: imported when a DHT client is made, not to check an address
    from p2pdiloco.net.dht import DHTPlane


def bootstrap_addrs(flags: list[str] | None) -> tuple[list[str], str]:
    """The bootstrap multiaddrs and where they came from; UserError if there are none or one
    is malformed (refused here, not after the DHT's start-up timeout)."""
    addrs, source = resolve_bootstrap(flags)
    if not addrs:
        raise UserError(
            "no bootstrap server configured: pass --bootstrap ADDR, set P2PDILOCO_BOOTSTRAP, "
            "or add bootstrap = [...] to ~/.config/p2pdiloco/config.toml"
        )
    check_multiaddrs(addrs, source)
    return addrs, source


def check_multiaddrs(addrs: list[str], source: str) -> None:
    """ConfigError naming the first address that is not /ip4|ip6|dns*/HOST/tcp/PORT/p2p/ID."""
    from p2pdiloco.preflight.network import parse_bootstrap

    for addr in addrs:
        why = parse_bootstrap(addr)
        if isinstance(why, str):
            raise ConfigError(
                f"bad bootstrap address '{addr}' (from {source}): {why}; copy the full "
                "multiaddr the bootstrap server prints at start, like "
                "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
            )


@contextlib.contextmanager
def dht_client(flags: list[str] | None) -> Iterator[DHTPlane]:
    """A client-mode DHT node with a throw-away key (it serves nothing and signs nothing)."""
    addrs, _ = bootstrap_addrs(flags)
    from p2pdiloco.net.dht import DHTPlane

    with DHTPlane(Identity.generate(), initial_peers=addrs, client_mode=True) as dht:
        yield dht
