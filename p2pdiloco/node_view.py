"""Plain-data views of a running node for the dashboard, log lines and metrics.

The dashboard renders a ``DashboardSnapshot`` (``dashboard/live.py``); this module is the only
place that knows how to read one off a ``Node`` and its ``Participant``. Rates (tokens/s,
bandwidth) are computed here between two calls, so the training loop only keeps counters.
"""

from __future__ import annotations

import time
from typing import Any

from p2pdiloco.dashboard.live import DashboardSnapshot
from p2pdiloco.net import sync_rpc
from p2pdiloco.node import Node
from p2pdiloco.participant import Participant


class NodeView:
    """Call ``snapshot()`` a few times a second; it is cheap and thread-safe enough to read."""

    def __init__(self, node: Node, participant: Participant | None) -> None:
        self.node = node
        self.participant = participant
        self._last = (time.monotonic(), 0, 0)
        self._rates = (0.0, 0.0)

    def _bandwidth(self) -> tuple[int, int, float, float]:
        up, down = sync_rpc.TRAFFIC["up"], sync_rpc.TRAFFIC["down"]
        now = time.monotonic()
        t0, up0, down0 = self._last
        if now - t0 >= 1.0:
            self._rates = ((up - up0) / (now - t0), (down - down0) / (now - t0))
            self._last = (now, up, down)
        return up, down, *self._rates

    def snapshot(self) -> DashboardSnapshot:
        node, p = self.node, self.participant
        ns = node.snapshot()
        peers = [x for x in ns["peers"] if x["peer_id"] != ns["peer_id"]]
        relayed = sum(1 for x in peers if x["reachability"] == "relayed")
        up, down, up_rate, down_rate = self._bandwidth()
        snap = DashboardSnapshot(
            peer_id=ns["peer_id"],
            run_id=ns["run_id"],
            run_name=ns["run_name"],
            model=ns["model"],
            state="connecting" if p is None else "idle",
            version=ns["version"],
            peers_direct=len(peers) - relayed,
            peers_relayed=relayed,
            islands=len({x.get("island", x["peer_id"]) for x in peers}) + 1,
            reachability=ns["reachability"],
            bytes_up=up,
            bytes_down=down,
            up_rate=up_rate,
            down_rate=down_rate,
            events=list(node.events[-5:]),
        )
        if p is None:
            return snap
        s = p.stats
        phase = p.phase
        # The participant's phases are the dashboard's states, but for these two spellings.
        snap.state = (
            "connecting" if phase == "starting" else "idle" if phase.startswith("idle") else phase
        )
        snap.paused_reason = s.paused_reason
        snap.version = p.state.version if hasattr(p, "state") else 0
        H = p.manifest.inner_steps
        snap.inner_step = min(s.inner_step, H)
        snap.inner_steps = H
        snap.eta_seconds = max(0, H - s.inner_step) * s.step_seconds if s.step_seconds else None
        snap.tokens_per_second = s.tokens_per_second
        snap.loss_local = list(s.losses)
        snap.loss_global = list(s.eval_losses)
        committee = p.service.committee if hasattr(p, "service") else None
        if committee is not None and p.me in committee.members:
            role = "leader" if committee.members[0] == p.me else "member"
            snap.committee_duty = f"syncer ({role}) for version {committee.version}"
        elif committee is not None:
            snap.committee_duty = f"none for version {committee.version}"
        snap.accepted, snap.rejected = s.accepted, s.rejected
        snap.tokens_contributed = s.tokens_accepted
        total = sum(s.tokens_by_peer.values())
        snap.share = s.tokens_accepted / total if total else 0.0
        ranked = sorted(s.tokens_by_peer.items(), key=lambda kv: (-kv[1], kv[0]))
        snap.ranked_peers = len(ranked)
        snap.rank = next((i for i, (peer, _) in enumerate(ranked, 1) if peer == p.me), None)
        snap.events = list(s.events)[-5:] or snap.events
        return snap

    def metrics(self) -> dict[str, Any]:
        """Flat numbers for ``node_metrics`` (Prometheus) and ``/api/v1/state``."""
        snap = self.snapshot()
        p = self.participant
        return {
            "peer_id": snap.peer_id,
            "run_id": snap.run_id,
            "state": snap.state,
            "version": snap.version,
            "tokens_per_second": snap.tokens_per_second,
            "tokens_trained": p.stats.tokens_trained if p else 0,
            "tokens_accepted": snap.tokens_contributed,
            "sent": p.stats.sent if p else 0,
            "accepted": snap.accepted,
            "rejected": snap.rejected,
            "rounds": snap.version,
            "bytes_up": snap.bytes_up,
            "bytes_down": snap.bytes_down,
            "peers_direct": snap.peers_direct,
            "peers_relayed": snap.peers_relayed,
            "on_committee": snap.committee_duty.startswith("syncer"),
        }
