"""What the network commands share: bootstrap resolution and a short-lived DHT client."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
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


# Seconds a bootstrap server has to accept a TCP connection before the DHT daemon starts: a
# dead or unreachable one is refused in this long, not after the daemon's own 20 s.
BOOTSTRAP_PROBE_S = 2.5


class BootstrapUnreachable(UserError):
    """No bootstrap server (nor any peer remembered from earlier runs) accepted a connection."""


def require_an_answer(
    addrs: list[str],
    source: str,
    remembered: Sequence[str] = (),
    timeout: float = BOOTSTRAP_PROBE_S,
) -> None:
    """Return once any of ``addrs`` or ``remembered`` (peers' addresses from earlier runs)
    answers as a libp2p node within ``timeout`` (all tried at once); BootstrapUnreachable naming
    what was tried, and what to check, if none does. The first line of the handshake only: a
    wrong peer id after /p2p/ is the DHT's to report (``net.dht``)."""
    from p2pdiloco.preflight.network import probe_addresses

    results = probe_addresses([*addrs, *remembered], timeout)
    if any(reason is None for _, reason in results):
        return
    tried = "; ".join(f"{addr} ({reason})" for addr, reason in results[: len(addrs)])
    more = ""
    if remembered:
        more = f", and {len(remembered)} address(es) of peers remembered from earlier runs"
    ports = ", ".join(sorted({a.split("/tcp/")[1].split("/")[0] for a in addrs if "/tcp/" in a}))
    raise BootstrapUnreachable(
        f"no bootstrap server answered within {timeout:g} s: tried {tried} (from {source})"
        f"{more}; check that the server is running and that this is the address it printed at "
        f"start, and that this machine may open TCP connections to port {ports}"
    )


@contextlib.contextmanager
def dht_client(flags: list[str] | None) -> Iterator[DHTPlane]:
    """A client-mode DHT node with a throw-away key (it serves nothing and signs nothing);
    BootstrapUnreachable within seconds when no bootstrap server answers."""
    addrs, source = bootstrap_addrs(flags)
    require_an_answer(addrs, source)
    from p2pdiloco.net.dht import DHTPlane

    with DHTPlane(Identity.generate(), initial_peers=addrs, client_mode=True) as dht:
        yield dht
