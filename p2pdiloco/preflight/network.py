"""Preflight checks that concern the network: bootstrap addresses (syntax, and a TCP connect
answered by a libp2p node), and what a joined node measured (reachability, clock offset, the run's protocol)."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from dataclasses import dataclass

from p2pdiloco.preflight.findings import Finding, PreflightConfig
from p2pdiloco.protocol.signing import PROTOCOL_VERSION

# Clock offsets (seconds) past which signed records with TTLs start to be judged wrongly.
CLOCK_WARN_S = 5.0
CLOCK_ERROR_S = 60.0
NTP_FIX = "enable NTP time sync: `sudo timedatectl set-ntp true` (or your OS's equivalent)"
# The first message of a libp2p connection (multistream-select 1.0.0, varint-length-prefixed):
# a libp2p node answers it with the same bytes.
MULTISTREAM = b"\x13/multistream/1.0.0\n"
_BASE58 = set("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")
_ADDR_FAMILY = {
    "ip4": socket.AF_INET,
    "ip6": socket.AF_INET6,
    "dns4": socket.AF_INET,
    "dns6": socket.AF_INET6,
    "dns": socket.AF_UNSPEC,
}


@dataclass(frozen=True)
class _Target:
    address: str
    host: str
    port: int
    family: int


def parse_bootstrap(address: str) -> _Target | str:
    """``/ip4|ip6|dns4|dns6|dns/HOST/tcp/PORT/p2p/ID`` → target, or why it is malformed."""
    parts = address.strip().split("/")
    if len(parts) != 7 or parts[0] != "":
        return "expected /ip4/HOST/tcp/PORT/p2p/PEER_ID"
    _, proto, host, tcp, port_s, p2p, peer = parts
    if proto not in _ADDR_FAMILY:
        return f"'{proto}' is not one of ip4, ip6, dns4, dns6"
    if proto in ("ip4", "ip6"):
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return f"'{host}' is not an {proto} address"
        if ip.version != int(proto[-1]):
            return f"'{host}' is not an {proto} address"
    elif not host:
        return "empty host name"
    if tcp != "tcp":
        return f"expected 'tcp' after the host, not '{tcp}'"
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        return f"'{port_s}' is not a TCP port"
    if p2p != "p2p" or not peer or not set(peer) <= _BASE58:
        return "expected /p2p/PEER_ID (base58) at the end"
    return _Target(address, host, int(port_s), _ADDR_FAMILY[proto])


def _tcp_connect(target: _Target, timeout: float) -> str | None:
    """None if a libp2p node answers at ``target`` within ``timeout``, else why not: a TCP
    connection, then the first line of libp2p's protocol negotiation (multistream-select),
    answered in kind. A connection alone proves little: a firewall or transparent proxy may
    accept any TCP connection and never pass it on."""
    try:
        infos = socket.getaddrinfo(target.host, target.port, target.family, socket.SOCK_STREAM)
    except OSError:
        return f"cannot resolve {target.host}"
    reason = "no address"
    deadline = time.monotonic() + timeout
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout)
            try:
                s.connect(sockaddr)
                s.sendall(MULTISTREAM)
                return _negotiation_answer(s, deadline, timeout)
            except ConnectionRefusedError:
                reason = "connection refused"
            except TimeoutError:
                reason = f"no answer within {timeout:g} s"
            except OSError as e:
                reason = e.strerror or str(e)
    return reason


def _negotiation_answer(s: socket.socket, deadline: float, timeout: float) -> str | None:
    """None if ``s`` answers with libp2p's multistream header; else what it did instead."""
    got = b""
    while len(got) < len(MULTISTREAM):
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(len(MULTISTREAM) - len(got))
        except TimeoutError:
            return f"accepted a connection but said nothing within {timeout:g} s (not libp2p?)"
        if not chunk:
            return "closed the connection at once (not a libp2p node?)"
        got += chunk
    if got != MULTISTREAM:
        first = got.decode("ascii", "replace").split("\r")[0].strip()
        return f"answered as something else than libp2p ({first[:24]!r}...: another server?)"
    return None


def check_bootstrap(cfg: PreflightConfig) -> list[Finding]:
    """One finding per bootstrap address: a TCP connect answered by a libp2p node (the first
    line of its protocol negotiation, ``_tcp_connect``) within ``cfg.timeout``, all addresses
    at once. An unreachable address is an error when none is
    reachable, else a warning; a malformed one is always an error. Name resolution for dns
    addresses is bounded only by the overall deadline (2 × timeout + 1 s)."""
    if not cfg.bootstrap:
        from p2pdiloco.config import config_path

        return [
            Finding(
                "bootstrap",
                "error",
                "no bootstrap server configured",
                fix="pass --bootstrap /ip4/HOST/tcp/PORT/p2p/PEER_ID, set P2PDILOCO_BOOTSTRAP, "
                f'or add bootstrap = ["..."] to {config_path()}',
            )
        ]
    malformed: list[Finding] = []
    targets: list[_Target] = []
    for addr in cfg.bootstrap:
        parsed = parse_bootstrap(addr)
        if isinstance(parsed, str):
            malformed.append(
                Finding(
                    "bootstrap",
                    "error",
                    f"malformed address '{addr}': {parsed}",
                    fix="copy the full multiaddr the bootstrap server prints at start",
                )
            )
        else:
            targets.append(parsed)
    results = _connect_all(targets, cfg.timeout)
    any_ok = any(reason is None for reason, _ in results)
    found = []
    for t, (reason, seconds) in zip(targets, results, strict=True):
        where = f"{t.host}:{t.port}"
        if reason is None:
            found.append(Finding("bootstrap", "ok", f"{where} reachable ({seconds * 1e3:.0f} ms)"))
        else:
            found.append(
                Finding(
                    "bootstrap",
                    "warn" if any_ok else "error",
                    f"{where} unreachable: {reason}",
                    fix=f"check the address and that the server is up; allow outgoing TCP to "
                    f"port {t.port} in your firewall; or pass --bootstrap with another server",
                )
            )
    return found + malformed


def _connect_all(targets: list[_Target], timeout: float) -> list[tuple[str | None, float]]:
    # Daemon threads: a name lookup stuck past the deadline must not hold the process open.
    results: list[tuple[str | None, float]] = [("no answer (name lookup hung?)", 0.0)] * len(
        targets
    )

    def probe(i: int) -> None:
        t0 = time.monotonic()
        reason = _tcp_connect(targets[i], timeout)
        results[i] = (reason, time.monotonic() - t0)

    threads = [threading.Thread(target=probe, args=(i,), daemon=True) for i in range(len(targets))]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 2 * timeout + 1
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    return list(results)


def probe_addresses(addresses: list[str], timeout: float) -> list[tuple[str, str | None]]:
    """Each address with None if a libp2p node answered there within ``timeout``
    (``_tcp_connect``), else why not; all at once, so the whole probe takes about ``timeout`` at most (a name lookup
    that hangs is given up after 2 × timeout + 1 s)."""
    targets, results = [], []
    for addr in addresses:
        parsed = parse_bootstrap(addr)
        if isinstance(parsed, str):
            results.append((addr, f"malformed: {parsed}"))
        else:
            targets.append(parsed)
    reasons = _connect_all(targets, timeout)
    return [(t.address, reason) for t, (reason, _) in zip(targets, reasons, strict=True)] + results


def check_reachability(status: str | None, fix: str = "") -> Finding:
    """Raises ValueError for a status other than direct, relayed, unknown or None."""
    if status == "direct":
        return Finding("reachability", "ok", "peers can dial this node directly")
    if status == "relayed":
        return Finding(
            "reachability",
            "warn",
            "peers reach this node only through a relay (slower state transfers)",
            fix=fix or "open or forward the node's TCP ports (--port and --port+1) to this host",
        )
    if status in ("unknown", None):
        return Finding(
            "reachability",
            "info",
            "not measured here: `join` asks a bootstrap server to dial it back, and prints it",
        )
    raise ValueError(f"unknown reachability status {status!r}")


def check_clock(offset_seconds: float | None) -> Finding:
    """The clock against peers': heartbeats and records expire on wall-clock time."""
    if offset_seconds is None:
        return Finding("clock", "info", "offset from peers not measured")
    detail = f"clock is {offset_seconds:+.1f} s off the network's"
    if abs(offset_seconds) < CLOCK_WARN_S:
        return Finding("clock", "ok", detail)
    if abs(offset_seconds) < CLOCK_ERROR_S:
        return Finding("clock", "warn", detail, fix=NTP_FIX)
    return Finding("clock", "error", detail + "; peers will reject its records", fix=NTP_FIX)


def check_protocol(manifest_protocol: int | None) -> Finding:
    if manifest_protocol is None:
        return Finding("protocol", "info", f"speaks protocol {PROTOCOL_VERSION}; run not checked")
    if manifest_protocol == PROTOCOL_VERSION:
        return Finding("protocol", "ok", f"run and this node speak protocol {PROTOCOL_VERSION}")
    detail = f"run speaks protocol {manifest_protocol}, this p2pdiloco {PROTOCOL_VERSION}"
    if manifest_protocol > PROTOCOL_VERSION:
        fix = "upgrade: pip install -U p2pdiloco"
    else:
        fix = (
            f"join a run on protocol {PROTOCOL_VERSION}, or install a p2pdiloco release that "
            f"speaks protocol {manifest_protocol}"
        )
    return Finding("protocol", "error", detail, fix=fix)
