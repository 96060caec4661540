"""Is a TCP port free to listen on? Asked before any daemon starts, so a taken port is one line.

The libp2p daemon binds with SO_REUSEPORT, so a second daemon on a taken port can start anyway
and advertise an address it does not own; a plain bind test here (SO_REUSEADDR, like the HTTP
servers, so sockets in TIME_WAIT do not count) finds the port taken first. The test closes its
socket at once: whatever starts next may still lose a race for the port, which then fails the
usual way.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

from p2pdiloco.errors import UserError


class PortUnavailable(UserError):
    """A port this command must listen on is taken (or the host is not an interface here)."""


def bind_error(host: str, port: int) -> OSError | None:
    """None if a TCP socket can bind (host, port) now, else the OSError the bind raised."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        return OSError(errno.EADDRNOTAVAIL, f"cannot resolve '{host}': {e.strerror}")
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            return e
    return None


def check_ports(wanted: Iterable[tuple[str, int, str, str]]) -> None:
    """Raise PortUnavailable for the first (host, port, what listens there, flag) that cannot be
    bound; port 0 (the system picks one) is always fine, and one fixed port wanted twice is
    refused the same way."""
    seen: dict[int, tuple[str, str]] = {}
    for host, port, what, flag in wanted:
        if port == 0:
            continue
        if not 0 < port < 65536:
            raise PortUnavailable(f"{flag} {port} is not a TCP port; pass one of 1..65535")
        if port in seen and _overlap(seen[port][0], host):
            raise PortUnavailable(
                f"port {port} is wanted twice, by the {seen[port][1]} and the {what}; "
                f"pass a different {flag}"
            )
        seen[port] = (host, what)
        err = bind_error(host, port)
        if err is None:
            continue
        if err.errno == errno.EADDRINUSE:
            raise PortUnavailable(
                f"cannot listen on {host}:{port} for the {what}: the port is already in use; "
                f"stop what holds it (`ss -ltnp 'sport = :{port}'` shows it) or pass another "
                f"{flag}"
            )
        if err.errno == errno.EACCES:
            raise PortUnavailable(
                f"cannot listen on {host}:{port} for the {what}: ports below 1024 need root; "
                f"pass {flag} 1024 or above"
            )
        reason = err.strerror or str(err)
        raise PortUnavailable(
            f"cannot listen on {host}:{port} for the {what}: {reason}; pass a --host this "
            f"machine has (0.0.0.0 for all interfaces) or another {flag}"
        )


def _overlap(a: str, b: str) -> bool:
    """Whether listeners on hosts ``a`` and ``b`` would share an interface."""
    wildcard = ("", "0.0.0.0", "::")
    return a == b or a in wildcard or b in wildcard
