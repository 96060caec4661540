"""What a bootstrap server says about the network: one log line per meaningful event, noise
aggregated, and a leaderboard gathered from the certificate records it sees.

``NetworkWatch.update(state)`` compares two successive ``/api/v1/state`` snapshots and returns
one line per event (run published, peer joined or left, version certified). It is a pure
function of the snapshots, so the tests feed it dicts. ``NoiseFilter`` turns the transport
libraries' per-dial errors (``Failed to open TCP stream: …``, a line for every unreachable
address a peer announces) into one summary line per period.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.protocol.signing import InvalidRecord

# Certificates neither the DHT (16 KiB) nor gossip (256 KiB) carries, a round of over about
# 1,400 inputs, a bootstrap fetches from the peers that announce them: this many a poll, of
# the newest this many versions (``NetworkWatch.unheard``).
UNHEARD_PER_POLL = 4
UNHEARD_DEPTH = 256

# Messages of hivemind, p2pd and py-libp2p that report one failed dial or connection each.
NOISE = (
    "Failed to open TCP stream",
    "failed to dial",
    "Failed to connect",
    "failed to connect",
    "Connection refused",
    "connection refused",
    "dial backoff",
    "all dials failed",
)


class NoiseFilter(logging.Filter):
    """Lets the first connection error through as it is, then at most one line per ``period``
    seconds: ``N connection errors in the last M s (latest: …)``. Other records pass untouched.

    The count of a window is reported with the first error after the window ends; a window
    after which no error comes is not reported (nothing is going wrong then).
    """

    def __init__(self, period: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.period, self.clock = period, clock
        self._lock = threading.Lock()
        self._since: float | None = None
        self._count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if not any(n in msg for n in NOISE):
            return True
        now = self.clock()
        with self._lock:
            if self._since is None:
                self._since = now
                return True
            self._count += 1
            if now - self._since < self.period:
                return False
            count, span = self._count, now - self._since
            self._count, self._since = 0, now
        record.msg = f"{count} connection errors in the last {span:.0f} s (latest: {msg[:160]})"
        record.args = ()
        return True


def install_noise_filter(period: float = 60.0) -> NoiseFilter:
    """Put one ``NoiseFilter`` on every handler that prints this process's log records (the
    root's, hivemind's own, and Python's last-resort handler). Call it before starting the DHT
    or gossip processes: a forked child inherits the handlers with their filter."""
    noise = NoiseFilter(period)
    handlers = [*logging.getLogger().handlers, *logging.getLogger("hivemind").handlers]
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for h in handlers:
        if not any(isinstance(f, NoiseFilter) for f in h.filters):
            h.addFilter(noise)
    return noise


def short(peer_id: str) -> str:
    return "…" + peer_id[-8:]


class NetworkWatch:
    """Events between successive network-state snapshots, and verified contributions."""

    def __init__(self) -> None:
        self._runs: dict[str, str] = {}  # run id → name
        self._peers: set[tuple[str, str]] = set()  # (run id, peer id)
        self._versions: dict[str, int] = {}  # run id → newest version announced by ≥ 2 peers
        self._seen: set[tuple[str, int]] = set()  # (run id, version) counted in the board
        self.board: dict[str, dict[str, dict[str, int]]] = {}  # run → peer → counts
        self._started = False

    def update(self, state: dict[str, Any]) -> list[str]:
        """One line per event since the previous snapshot; the first one gives a summary."""
        first, self._started = not self._started, True
        lines: list[str] = []
        runs = {r["run_id"]: str(r["name"]) for r in state["runs"] if not r.get("incompatible")}
        for run_id, name in runs.items():
            if run_id not in self._runs and not first:
                lines.append(f"run published: {name} ({run_id[:12]})")
        peers = {(p["run_id"], p["peer_id"]): p for p in state["peers"]}
        if not first:
            for key in sorted(peers.keys() - self._peers):
                p = peers[key]
                lines.append(
                    f"peer {short(key[1])} joined run {runs.get(key[0], key[0][:12])} "
                    f"({p['reachability']}, island {p['island']})"
                )
            for run_id, peer in sorted(self._peers - peers.keys()):
                name = runs.get(run_id, self._runs.get(run_id, run_id[:12]))
                lines.append(f"peer {short(peer)} left run {name}")
        for run_id, name in runs.items():
            held = sorted(
                (p["version"] for (r, _), p in peers.items() if r == run_id), reverse=True
            )
            # A version one peer claims is a claim; one that two announce was certified (a
            # single peer of a run is believed, as it is all there is to see).
            version = held[min(1, len(held) - 1)] if held else 0
            if version > self._versions.get(run_id, 0) and not first:
                lines.append(
                    f"run {name}: version {version} certified "
                    f"(announced by {sum(v >= version for v in held)} of {len(held)} peers)"
                )
            self._versions[run_id] = max(version, self._versions.get(run_id, 0))
        if first:
            lines.append(f"watching {len(runs)} run(s) with {len(peers)} live peer(s)")
        self._runs.update(runs)
        self._peers = set(peers)
        return lines

    def add_certificates(self, run_id: str, raws: Iterable[bytes]) -> None:
        """Count the receipts of certificates found in the DHT or heard on gossip, once per
        version. Each must carry a quorum of valid committee signatures; the chain back to
        genesis is not checked here (``status --leaderboard`` does that), so the board is
        labelled as such."""
        board = self.board.setdefault(run_id, {})
        for raw in raws:
            try:
                cert = parse_certificate(raw, run_id=run_id)
            except InvalidRecord:
                continue
            key = (run_id, cert.body.version)
            if key in self._seen or len(self._seen) > 100_000:
                continue
            self._seen.add(key)
            for a in cert.body.accepted:
                entry = board.setdefault(a.peer_id, {"accepted": 0, "tokens": 0})
                entry["accepted"] += 1
                entry["tokens"] += a.tokens

    def counted(self, run_id: str, version: int) -> bool:
        return (run_id, version) in self._seen

    def unheard(self, run_id: str, limit: int = UNHEARD_PER_POLL) -> list[int]:
        """Versions up to the newest ``update`` believes certified (two peers announce it; the
        only peer of a one-peer run) whose certificate the board has not counted, newest
        first: at most ``limit`` of the newest ``UNHEARD_DEPTH``."""
        top = self._versions.get(run_id, 0)
        low = max(1, top - UNHEARD_DEPTH + 1)
        return [v for v in range(top, low - 1, -1) if (run_id, v) not in self._seen][:limit]

    def leaderboard(self, run_id: str) -> list[dict[str, Any]]:
        rows = sorted(self.board.get(run_id, {}).items(), key=lambda kv: (-kv[1]["tokens"], kv[0]))
        total = sum(e["tokens"] for _, e in rows) or 1
        return [
            {"rank": i, "peer_id": p, **e, "share": e["tokens"] / total}
            for i, (p, e) in enumerate(rows[:100], 1)
        ]
