"""Peers a node met in earlier lives, remembered on disk so a restart does not need a bootstrap.

A node's only way into the DHT used to be its bootstrap servers: a node restarted while they
were down, or in the first seconds after one restarted with an empty routing table, exited
with "cannot join the DHT" or "run not found" (the chaos run, docs/benchmarks.md). Now a node
writes the DHT addresses of the live peers it hears from next to its identity key, and the next
start dials them beside the bootstrap servers: any one that answers lets it in.

The file is a hint, never trusted: it holds only addresses (what a peer says is checked by its
signed records once connected), is rewritten atomically, and a missing, unreadable or malformed
file is ignored with one warning.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = 1
MAX_PEERS = 8  # dialled at start beside the bootstrap servers: few, the most recently seen
MAX_ADDRS = 4  # per peer
MAX_FILE_BYTES = 64 * 1024
_MADDR = re.compile(r"^/[\x21-\x7e]{1,255}$")


@dataclass(frozen=True)
class KnownPeer:
    peer_id: str
    addrs: tuple[str, ...]  # full multiaddrs ending in /p2p/<peer_id>
    seen: float  # unix time of its last heartbeat we heard


def known_peers_path(identity_path: Path) -> Path:
    """Where the node with key file ``identity_path`` remembers its peers (one file per key)."""
    return identity_path.with_name(identity_path.name + ".peers.json")


def _usable(peer_id: str, addr: str) -> bool:
    # Relayed addresses go through a relay that may be gone too; direct ones only.
    return (
        bool(_MADDR.match(addr)) and addr.endswith(f"/p2p/{peer_id}") and "/p2p-circuit" not in addr
    )


def select(peers: Iterable[KnownPeer], me: str, limit: int = MAX_PEERS) -> list[KnownPeer]:
    """The ``limit`` most recently seen peers other than ``me``, each with its usable addresses
    (at most MAX_ADDRS); peers left with none are dropped."""
    best: dict[str, KnownPeer] = {}
    for p in peers:
        addrs = tuple(a for a in p.addrs if _usable(p.peer_id, a))[:MAX_ADDRS]
        if p.peer_id == me or not addrs:
            continue
        if p.peer_id not in best or best[p.peer_id].seen < p.seen:
            best[p.peer_id] = KnownPeer(p.peer_id, addrs, p.seen)
    return sorted(best.values(), key=lambda p: (-p.seen, p.peer_id))[:limit]


def load(path: Path, me: str) -> list[KnownPeer]:
    """The peers remembered in ``path`` (most recent first); [] with a warning if it is
    unreadable or malformed, [] silently if there is none yet."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("ignoring the known-peers file %s: %s", path, e)
        return []
    try:
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"{len(raw)} bytes, more than {MAX_FILE_BYTES}")
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a format-{FORMAT} known-peers file")
        items = doc.get("peers")
        if not isinstance(items, list):
            raise ValueError("'peers' is not a list")
        peers = []
        for item in items:
            pid, addrs, seen = item.get("peer_id"), item.get("addrs"), item.get("seen")
            if not (
                isinstance(pid, str)
                and isinstance(addrs, list)
                and all(isinstance(a, str) for a in addrs)
                and isinstance(seen, int | float)
            ):
                raise ValueError("a peer entry lacks peer_id, addrs or seen")
            peers.append(KnownPeer(pid, tuple(addrs), float(seen)))
    except (ValueError, AttributeError) as e:
        log.warning("ignoring the known-peers file %s: %s", path, e)
        return []
    return select(peers, me)


def save(path: Path, peers: Sequence[KnownPeer], me: str) -> None:
    """Remember ``peers`` (the MAX_PEERS most recent usable ones) in ``path``, atomically; a
    disk error is logged, never raised (the file is only a hint)."""
    chosen = select(peers, me)
    if not chosen:
        return
    doc = {
        "format": FORMAT,
        "written": round(time.time(), 3),
        "peers": [{"peer_id": p.peer_id, "addrs": list(p.addrs), "seen": p.seen} for p in chosen],
    }
    from p2pdiloco.train.checkpoint import atomic_write_bytes  # torch: not needed to read

    try:
        atomic_write_bytes(path, json.dumps(doc, indent=1).encode(), durable=False)
    except OSError as e:
        log.warning("could not remember peers in %s: %s", path, e)


def initial_peers(bootstrap: Sequence[str], remembered: Sequence[KnownPeer]) -> list[str]:
    """The addresses a start dials: the bootstrap servers first, then the remembered peers'."""
    out = list(dict.fromkeys(bootstrap))
    for p in remembered:
        out += [a for a in p.addrs if a not in out]
    return out
