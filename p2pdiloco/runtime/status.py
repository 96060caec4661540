"""What the runtime counts, and the immutable views it publishes for other threads.

``Tally`` is mutated on the runtime's loop only. ``RuntimeView`` is a frozen copy made after
each change; the dashboard, the metrics endpoint and the status file read views, never the
tally. Contributions (accepted deltas, tokens, shares) come from verified certificates only.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pdiloco.ledger import Ledger
from p2pdiloco.protocol.certificates import Certificate

log = logging.getLogger("p2pdiloco.runtime")


@dataclass
class Tally:
    phase: str = "starting"
    sent: int = 0  # submissions handed to the committee
    accepted: int = 0  # our deltas merged (receipts in certificates)
    tokens_accepted: int = 0
    tokens_by_peer: dict[str, int] = field(default_factory=dict)  # from verified receipts
    downloads: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=20))
    events: deque[str] = field(default_factory=lambda: deque(maxlen=50))
    eval_losses: deque[float] = field(default_factory=lambda: deque(maxlen=48))
    paused_reason: str | None = None

    def event(self, text: str) -> None:
        log.info(text)
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")

    def load_ledger(self, ledger: Ledger, me: str) -> None:
        for line in ledger.ignored:
            log.warning("ledger: %s", line)
        for e in ledger.entries:
            self.tokens_by_peer[e.peer_id] = e.tokens
            if e.peer_id == me:
                self.accepted, self.tokens_accepted = e.accepted, e.tokens

    def record_download(self, version: int, chunks_by_peer: dict[str, int]) -> None:
        self.downloads.append({"version": version, "chunks_by_peer": chunks_by_peer})
        self.event(
            f"downloaded state of version {version} from {len(chunks_by_peer)} peers ("
            + ", ".join(f"{p[-8:]}: {n}" for p, n in chunks_by_peer.items())
            + ")"
        )

    def record_chain(self, chain: list[Certificate], me: str) -> set[str]:
        """Count the receipts of newly applied certificates; every digest they merged."""
        merged = set()
        for c in chain:
            for a in c.body.accepted:
                self.tokens_by_peer[a.peer_id] = self.tokens_by_peer.get(a.peer_id, 0) + a.tokens
                merged.add(a.digest)
            for a in c.receipts(me):
                self.accepted += 1
                self.tokens_accepted += a.tokens
        return merged

    def view(
        self,
        *,
        version: int,
        committee: tuple[str, ...],
        committee_version: int,
        me: str,
        rejections: tuple[dict[str, Any], ...],
    ) -> RuntimeView:
        total = sum(self.tokens_by_peer.values())
        ranked = sorted(self.tokens_by_peer.items(), key=lambda kv: (-kv[1], kv[0]))
        return RuntimeView(
            phase=self.phase,
            version=version,
            committee=committee,
            committee_version=committee_version,
            on_committee=me in committee,
            sent=self.sent,
            accepted=self.accepted,
            tokens_accepted=self.tokens_accepted,
            share=self.tokens_accepted / total if total else 0.0,
            ranked_peers=len(ranked),
            rank=next((i for i, (p, _) in enumerate(ranked, 1) if p == me), None),
            downloads=tuple(self.downloads),
            events=tuple(self.events),
            eval_losses=tuple(self.eval_losses),
            paused_reason=self.paused_reason,
            rejections=rejections[-200:],
        )


@dataclass(frozen=True)
class RuntimeView:
    phase: str = "starting"
    version: int = 0
    committee: tuple[str, ...] = ()
    committee_version: int = 0
    on_committee: bool = False
    sent: int = 0
    accepted: int = 0
    tokens_accepted: int = 0
    share: float = 0.0
    ranked_peers: int = 0
    rank: int | None = None
    downloads: tuple[dict[str, Any], ...] = ()
    events: tuple[str, ...] = ()
    eval_losses: tuple[float, ...] = ()
    paused_reason: str | None = None
    rejections: tuple[dict[str, Any], ...] = ()

    def status_json(self, peer_id: str, run_id: str, trainer: Any) -> bytes:
        """``status.json``: one object for monitors, the demo and the tests."""
        t = trainer
        return json.dumps(
            {
                "peer_id": peer_id,
                "run_id": run_id,
                "phase": t.phase if t is not None else self.phase,
                "error": t.error if t is not None else None,
                "version": self.version,
                "committee": list(self.committee),
                "on_committee": self.on_committee,
                "sent": self.sent,
                "accepted": self.accepted,
                "rejected": t.lost if t is not None else 0,
                "tokens_accepted": self.tokens_accepted,
                "tokens_trained": t.tokens_trained if t is not None else 0,
                "last_loss": t.last_loss if t is not None else None,
                "downloads": list(self.downloads),
                "rejections": list(self.rejections),
            }
        ).encode()


def write_quietly(path: Path, data: bytes) -> None:
    """Write the status file atomically; a failure is logged, never raised (it is advisory)."""
    from p2pdiloco.train.checkpoint import atomic_write_bytes

    try:
        atomic_write_bytes(path, data, durable=False)
    except OSError as e:
        log.debug("status write failed: %s", e)
