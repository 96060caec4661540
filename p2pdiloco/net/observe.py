"""What a bootstrap server says about the network: one log line per meaningful event, noise
aggregated, and each run's version and leaderboard from its verified certificate chain.

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

from p2pdiloco.core.curve import LossCurve
from p2pdiloco.core.ledger import ChainFollower
from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord

# Certificates the chain lacks (neither the DHT, 16 KiB, nor gossip, 256 KiB, carries a round
# of over about 1,400 inputs) a bootstrap fetches from the peers that announce them: this many
# a poll (``NetworkWatch.unheard``); at most this many versions above the verified tip wait.
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
    """Events between successive network-state snapshots, and the contributions of each run's
    verified certificate chain.

    A run's version and leaderboard come from its chain alone: each certificate the bootstrap
    reads (DHT, gossip, fetched from peers) is verified as a successor from genesis
    (``ledger.ChainFollower``), so a self-appointed committee, a forged receipt or a heartbeat
    announcing a version nobody certified changes nothing here. Announcements only say which
    versions to fetch next (``unheard``). Memory is bounded: ``MAX_RUNS`` runs followed, a
    window of pending versions per run, the board only of verified receipts.
    """

    MAX_RUNS = 64  # runs followed at once; a manifest flood cannot grow the bootstrap

    def __init__(self) -> None:
        self._runs: dict[str, str] = {}  # run id → name
        self._peers: set[tuple[str, str]] = set()  # (run id, peer id)
        self._chains: dict[str, ChainFollower] = {}  # run id → its verified chain
        self._reported: dict[str, int] = {}  # run id → newest certified version logged
        self._announced: dict[str, int] = {}  # run id → newest version a live peer announces
        self.board: dict[str, dict[str, dict[str, int]]] = {}  # run → peer → counts
        self.curves: dict[str, LossCurve] = {}  # run → certified eval loss (ADR 0059)
        self._started = False

    def follow(self, run_id: str, manifest: RunManifest) -> None:
        """Verify this run's certificates from now on (its signed manifest elects the
        committees). A no-op for a run already followed or past ``MAX_RUNS``."""
        if run_id not in self._chains and len(self._chains) < self.MAX_RUNS:
            self._chains[run_id] = ChainFollower(run_id, manifest, ahead=UNHEARD_DEPTH, keep=2)

    def version(self, run_id: str) -> int:
        """The newest version of the run's verified chain (0: none yet)."""
        chain = self._chains.get(run_id)
        return chain.version if chain is not None else 0

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
            self._announced[run_id] = max(
                (p["version"] for (r, _), p in peers.items() if r == run_id), default=0
            )
            version = self.version(run_id)
            if version > self._reported.get(run_id, 0) and not first:
                lines.append(f"run {name}: version {version} certified (chain verified)")
            self._reported[run_id] = max(version, self._reported.get(run_id, 0))
        if first:
            lines.append(f"watching {len(runs)} run(s) with {len(peers)} live peer(s)")
        self._runs.update(runs)
        self._peers = set(peers)
        return lines

    def add_certificates(self, run_id: str, raws: Iterable[bytes]) -> None:
        """Count the receipts of the certificates that extend the run's verified chain, once
        each. A certificate of a run not followed, one without a quorum of valid signatures,
        or one that does not verify where it fits in the chain is dropped."""
        chain = self._chains.get(run_id)
        if chain is None:
            return
        board = self.board.setdefault(run_id, {})
        curve = self.curves.setdefault(run_id, LossCurve())
        for raw in raws:
            try:
                cert = parse_certificate(raw, run_id=run_id)
            except InvalidRecord:
                continue
            for grown in chain.offer(cert):
                curve.add(grown.body)
                for a in grown.body.accepted:
                    if not a.credited:  # merged, no work shown: no receipt (ADR 0065)
                        continue
                    entry = board.setdefault(a.peer_id, {"accepted": 0, "tokens": 0})
                    entry["accepted"] += 1
                    entry["tokens"] += a.tokens

    def counted(self, run_id: str, version: int) -> bool:
        return 1 <= version <= self.version(run_id)

    def unheard(self, run_id: str, limit: int = UNHEARD_PER_POLL) -> list[int]:
        """The next versions the chain needs, lowest first: at most ``limit`` of those above
        its tip up to the newest a live peer announces (an announcement is only a hint of what
        to fetch, never counted). Versions waiting in the chain are asked for again: what
        waits there may be forged."""
        chain = self._chains.get(run_id)
        if chain is None:
            return []
        top = min(self._announced.get(run_id, 0), chain.version + limit)
        return list(range(chain.version + 1, top + 1))

    def curve(self, run_id: str) -> list[dict[str, Any]]:
        """The run's certified loss curve (``core.curve``): version, tokens and eval loss of
        each evaluated version of the verified chain; empty for a run that evaluates nothing."""
        curve = self.curves.get(run_id)
        return curve.to_list() if curve is not None else []

    def leaderboard(self, run_id: str) -> list[dict[str, Any]]:
        rows = sorted(self.board.get(run_id, {}).items(), key=lambda kv: (-kv[1]["tokens"], kv[0]))
        total = sum(e["tokens"] for _, e in rows) or 1
        return [
            {"rank": i, "peer_id": p, **e, "share": e["tokens"] / total}
            for i, (p, e) in enumerate(rows[:100], 1)
        ]
