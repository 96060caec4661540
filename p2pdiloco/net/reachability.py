"""Can peers dial this node directly, or only through a relay?

A node asks a bootstrap server over a P2P stream to dial it back. The server opens plain TCP
connections to the *observed* IP of the requester (never to an address the requester names, so
the service cannot be used to probe third parties) on the ports the requester listens on, and
answers which ones connected. A node none of whose ports connect is reachable only through a
relay; the fix (the port to open or forward) is part of the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

log = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "/p2pdiloco/dialback/1"
_MAX_REQUEST = 1024
_MAX_PORTS = 8
DIAL_TIMEOUT = 3.0


@dataclass(frozen=True)
class Reachability:
    status: str  # "direct", "relayed" or "unknown"
    detail: str  # one line for the user
    fix: str = ""  # what to do about it, when relayed


def observed_ip(info: StreamInfo) -> str | None:
    """The requester's IP as this daemon sees the connection; None for relayed streams."""
    parts = str(info.addr).split("/")
    if "p2p-circuit" in parts:
        return None
    for proto in ("ip4", "ip6"):
        if proto in parts:
            return parts[parts.index(proto) + 1]
    return None


async def _tcp_dial(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


async def serve_dialback(p2p: P2P) -> None:
    """Register the dial-back handler on a bootstrap server's P2P instance."""

    async def handler(
        info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            if len(line) > _MAX_REQUEST:
                raise ValueError("request too large")
            ports = json.loads(line)["ports"]
            if not isinstance(ports, list) or not all(
                isinstance(p, int) and 0 < p < 65536 for p in ports
            ):
                raise ValueError("ports must be a list of TCP ports")
            ip = observed_ip(info)
            ok = []
            if ip is not None:
                results = await asyncio.gather(*(_tcp_dial(ip, p) for p in ports[:_MAX_PORTS]))
                ok = [p for p, r in zip(ports, results, strict=False) if r]
            reply = {"observed_ip": ip, "reachable_ports": ok}
        except (TimeoutError, ValueError, KeyError, TypeError) as e:
            log.warning("dial-back request from %s rejected: %s", info.peer_id, e)
            reply = {"error": str(e)}
        writer.write(json.dumps(reply).encode() + b"\n")
        await writer.drain()
        writer.close()

    await p2p.add_binary_stream_handler(DIALBACK_PROTOCOL, handler)


async def ask_dialback(p2p: P2P, server: str, ports: list[int], timeout: float = 10.0) -> dict:
    """Ask ``server`` (a peer id) to dial us back on ``ports``; its JSON reply."""
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(PeerID.from_base58(server), DIALBACK_PROTOCOL), timeout
    )
    try:
        writer.write(json.dumps({"ports": ports}).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        writer.close()
    reply = json.loads(line[:_MAX_REQUEST] or b"{}")
    if not isinstance(reply, dict):
        raise ValueError("malformed dial-back reply")
    return reply


def classify(replies: list[dict], ports: list[int]) -> Reachability:
    """Turn dial-back replies into a verdict with the exact fix when relayed."""
    answered = [r for r in replies if "reachable_ports" in r]
    if not answered:
        return Reachability("unknown", "no bootstrap server answered the dial-back check")
    if any(r["reachable_ports"] for r in answered):
        ip = next(r["observed_ip"] for r in answered if r["reachable_ports"])
        return Reachability("direct", f"peers can dial this node directly at {ip}")
    ip = answered[0].get("observed_ip") or "your public IP"
    port_list = ", ".join(str(p) for p in ports)
    return Reachability(
        "relayed",
        f"peers cannot dial {ip} on TCP port(s) {port_list}; traffic goes through a relay",
        fix=f"open or forward TCP port(s) {port_list} to this machine (or pass --port and forward that)",
    )
