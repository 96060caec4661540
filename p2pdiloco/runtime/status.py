"""What the runtime counts, and the immutable views it publishes for other threads.

``Tally`` is mutated on the runtime's loop only. ``RuntimeView`` is a frozen copy made after
each change; the dashboard, the metrics endpoint and the status file read views, never the
tally. Contributions (accepted deltas, tokens, shares) come from verified certificates only.

A stall: a node that sent a delta on version v expects the certificate of v+1 within the run's
``grace + agree_timeout`` (the round closes at the latest ``grace`` after it opened, which is
before our delta arrived, and each leader that fails to propose costs ``agree_timeout``). Past
that, the view says ``stalled: ...`` with what the node waits for (:func:`stall_text`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pdiloco.core.ledger import Ledger
from p2pdiloco.protocol.certificates import Certificate

log = logging.getLogger("p2pdiloco.runtime")


@dataclass
class Tally:
    phase: str = "starting"
    sent: int = 0  # submissions handed to the committee
    accepted: int = 0  # our deltas merged (receipts in certificates)
    uncredited: int = 0  # our deltas merged without credit: no work shown (ADR 0065)
    rejected: int = 0  # our deltas screened out, as certificates record (the leaderboard's)
    rejected_reasons: dict[str, int] = field(default_factory=dict)  # reason code → count
    tokens_accepted: int = 0
    tokens_by_peer: dict[str, int] = field(default_factory=dict)  # from verified receipts
    downloads: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=20))
    events: deque[str] = field(default_factory=lambda: deque(maxlen=50))
    eval_losses: deque[float] = field(default_factory=lambda: deque(maxlen=48))
    paused_reason: str | None = None
    stall_after: float = 0.0  # seconds without a certificate after sending; 0: never stalled
    waiting_since: float | None = None  # monotonic time of the first delta sent on this version
    # Seconds from each first send on a version to the next certified version, summed: what a
    # learner without overlap would have spent blocked (bench/utilization.py).
    sync_wait_s: float = 0.0
    stall_logged: bool = False  # the stall of this version has its event line
    progress_at: float = 0.0  # when the last download progress line was logged
    updates: int = 0  # versions made from the one before by their certified update (ADR 0029)
    update_fallbacks: int = 0  # versions whose update failed: the whole state was downloaded

    def download_progress(self, version: int, done: int, total: int, seconds: float) -> None:
        """A state download's bytes and rate: the phase shows it, one log line every 2 s."""
        rate = done / seconds / 1e6 if seconds > 0 else 0.0
        self.phase = f"downloading v{version} {done / 1e6:.1f}/{total / 1e6:.1f} MB"
        now = time.monotonic()
        if done >= total or now - self.progress_at >= 2.0:
            self.progress_at = now
            log.info(
                "downloading the state of version %d: %.1f of %.1f MB at %.1f MB/s",
                version,
                done / 1e6,
                total / 1e6,
                rate,
            )

    def on_sent(self) -> None:
        """A delta was handed to the committee: the stall clock starts if it is not running."""
        self.sent += 1
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()

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
                self.rejected, self.rejected_reasons = e.rejected, dict(e.reasons)

    def record_download(self, version: int, chunks_by_peer: dict[str, int]) -> None:
        self.downloads.append({"version": version, "chunks_by_peer": chunks_by_peer})
        self.event(
            f"downloaded state of version {version} from {len(chunks_by_peer)} peers ("
            + ", ".join(f"{p[-8:]}: {n}" for p, n in chunks_by_peer.items())
            + ")"
        )

    def record_chain(self, chain: list[Certificate], me: str) -> tuple[set[str], set[str]]:
        """Count the receipts and rejections of newly applied certificates; every digest they
        merged, and those of ours they rejected."""
        if self.waiting_since is not None:
            self.sync_wait_s += time.monotonic() - self.waiting_since
        self.waiting_since, self.stall_logged = None, False  # nothing awaited until a delta
        merged, rejected = set(), set()
        for c in chain:
            if c.body.eval_loss is not None:  # the certified curve (ADR 0059)
                self.eval_losses.append(c.body.eval_loss)
            for a in c.body.accepted:
                self.tokens_by_peer[a.peer_id] = self.tokens_by_peer.get(a.peer_id, 0) + a.tokens
                merged.add(a.digest)
            for a in c.receipts(me):
                self.accepted += 1
                self.tokens_accepted += a.tokens
            self.uncredited += sum(a.peer_id == me and not a.credited for a in c.body.accepted)
            for r in c.body.rejected:
                if r.peer_id == me:
                    self.rejected += 1
                    code = str(r.reason)
                    self.rejected_reasons[code] = self.rejected_reasons.get(code, 0) + 1
                    rejected.add(r.digest)
        return merged, rejected

    def view(
        self,
        *,
        version: int,
        committee: tuple[str, ...],
        committee_version: int,
        me: str,
        rejections: tuple[dict[str, Any], ...],
        statuses: Mapping[str, str] | None = None,
        now: float | None = None,
    ) -> RuntimeView:
        """``statuses``: each syncer's answer to the delta in flight ("error": unreachable)."""
        total = sum(self.tokens_by_peer.values())
        now = time.monotonic() if now is None else now
        waited = now - self.waiting_since if self.waiting_since is not None else 0.0
        stalled = 0 < self.stall_after < waited
        unreachable = [p for p, s in (statuses or {}).items() if s == "error"]
        stall = stall_text(version + 1, waited, committee, unreachable) if stalled else None
        if stall is not None and not self.stall_logged:
            self.stall_logged = True
            self.event(stall)
        ranked = sorted(self.tokens_by_peer.items(), key=lambda kv: (-kv[1], kv[0]))
        return RuntimeView(
            phase=self.phase,
            version=version,
            committee=committee,
            committee_version=committee_version,
            on_committee=me in committee,
            sent=self.sent,
            accepted=self.accepted,
            uncredited=self.uncredited,
            rejected=self.rejected,
            rejected_reasons=tuple(sorted(self.rejected_reasons.items())),
            tokens_accepted=self.tokens_accepted,
            share=self.tokens_accepted / total if total else 0.0,
            ranked_peers=len(ranked),
            rank=next((i for i, (p, _) in enumerate(ranked, 1) if p == me), None),
            downloads=tuple(self.downloads),
            events=tuple(self.events),
            eval_losses=tuple(self.eval_losses),
            paused_reason=self.paused_reason,
            rejections=rejections[-200:],
            stalled=stall,
            stalled_s=round(waited, 1) if stalled else 0.0,
            waiting_since=self.waiting_since,
            sync_wait_s=round(self.sync_wait_s, 2),
            updates=self.updates,
            update_fallbacks=self.update_fallbacks,
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
    uncredited: int = 0  # of ours, merged without credit (ADR 0065)
    rejected: int = 0  # of ours, screened out as certificates record
    rejected_reasons: tuple[tuple[str, int], ...] = ()  # (reason code, count)
    tokens_accepted: int = 0
    share: float = 0.0
    ranked_peers: int = 0
    rank: int | None = None
    downloads: tuple[dict[str, Any], ...] = ()
    events: tuple[str, ...] = ()
    eval_losses: tuple[float, ...] = ()
    paused_reason: str | None = None
    rejections: tuple[dict[str, Any], ...] = ()
    stalled: str | None = None  # "stalled: no certificate for version ... (waiting on ...)"
    stalled_s: float = 0.0  # seconds waited for that certificate, while stalled
    # monotonic time our first delta on this version went out (None: none in flight); a
    # reader counts the wait from it, as this view is republished only on changes
    waiting_since: float | None = None
    sync_wait_s: float = 0.0  # send → next certificate, summed over versions (Tally)
    updates: int = 0  # versions made by their certified update (ADR 0029)
    update_fallbacks: int = 0  # versions whose update failed: downloaded whole

    def status_json(
        self, peer_id: str, run_id: str, trainer: Any, traffic: Mapping[str, int] | None = None
    ) -> bytes:
        """``status.json``: one object for monitors, the demo and the tests. ``traffic``: the
        sync protocol's frame bytes sent and received by this process (``net.sync_rpc``)."""
        t = trainer
        traffic = traffic or {}
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
                "uncredited": self.uncredited,  # merged, no work shown: no credit
                "rejected": self.rejected,  # as certified: what the leaderboard counts
                "late": sum(n for _, n in t.late) if t is not None else 0,
                "lost": t.lost if t is not None else 0,  # every delta of ours not merged
                "tokens_accepted": self.tokens_accepted,
                "tokens_trained": t.tokens_trained if t is not None else 0,
                "last_loss": t.last_loss if t is not None else None,
                "tokens_per_second": t.tokens_per_second if t is not None else 0.0,
                "utilization": round(t.utilization, 4) if t is not None else 0.0,
                "train_seconds": round(t.train_seconds, 2) if t is not None else 0.0,
                "longest_pause_s": round(t.longest_pause_s, 2) if t is not None else 0.0,
                "stretch_s": round(t.stretch_s, 2) if t is not None else 0.0,
                "sync_wait_s": self.sync_wait_s,
                "stalled": self.stalled,
                "stalled_s": self.stalled_s,
                "downloads": list(self.downloads),
                "updates": self.updates,
                "update_fallbacks": self.update_fallbacks,
                "rejections": list(self.rejections),
                "bytes_up": int(traffic.get("up", 0)),
                "bytes_down": int(traffic.get("down", 0)),
                "learner_bytes_up": int(traffic.get("learner_up", 0)),
                "learner_bytes_down": int(traffic.get("learner_down", 0)),
            }
        ).encode()


def short_peer(peer_id: str) -> str:
    """How a peer id is shown in one line of text: its last 8 characters after an ellipsis."""
    return "…" + peer_id[-8:]


def stall_text(
    version: int, seconds: float, committee: Sequence[str], unreachable: Sequence[str] = ()
) -> str:
    """``stalled: no certificate for version 12 for 95 s (waiting on committee …a1b2c3d4, …;
    unreachable: …)``: what a stalled node waits for, in one line. Before the first
    certificate, a first committee none of whose members is up is said to be so (its members,
    the run's creator's nodes as a rule, have not joined yet)."""
    waits = ", ".join(map(short_peer, committee)) or "an unknown committee"
    text = f"stalled: no certificate for version {version} for {seconds:.0f} s (waiting on "
    text += f"committee {waits}" if committee else waits
    if unreachable:
        text += f"; unreachable: {', '.join(map(short_peer, unreachable))}"
    if version == 1 and committee and set(committee) <= set(unreachable):
        # The README walk of stop 51: volunteers joined a run whose creator's node was not up.
        text += "; no member of the run's first committee is up: it starts once they join"
    return text + ")"


def write_quietly(path: Path, data: bytes) -> None:
    """Write the status file atomically; a failure is logged, never raised (it is advisory)."""
    from p2pdiloco.train.checkpoint import atomic_write_bytes

    try:
        atomic_write_bytes(path, data, durable=False)
    except OSError as e:
        log.debug("status write failed: %s", e)
