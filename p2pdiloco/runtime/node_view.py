"""Plain-data views of a running node for the dashboard, log lines and metrics.

The dashboard renders a ``DashboardSnapshot`` (``dashboard/live.py``); this module is the only
place that knows how to build one from the immutable views the node publishes (the plane's,
the runtime's and the trainer's). It reads no live state, so it is safe from any thread. Rates
(bandwidth) are computed here between two calls.
"""

from __future__ import annotations

import time
from typing import Any

from p2pdiloco.dashboard.live import DashboardSnapshot
from p2pdiloco.net import sync_rpc
from p2pdiloco.node import Node
from p2pdiloco.runtime.launch import RunningNode
from p2pdiloco.sync.fragments import round_fragment

# The learner's phases, spelled as the dashboard's states: a learner with a delta in flight
# trains on (core.learner), so it is never shown as only waiting.
_STATES = {
    "waiting for certificate": "training, delta in flight",
    "training on (stretch done)": "overtime, awaiting certificate",
    "starting": "connecting",
}


class NodeView:
    """Call ``snapshot()`` a few times a second; it only reads published views."""

    def __init__(self, node: Node, running: RunningNode | None) -> None:
        self.node = node
        self.running = running
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
        ns: dict[str, Any] = dict(self.node.snapshot())
        peers = [x for x in ns.get("peers", []) if x["peer_id"] != ns["peer_id"]]
        # An island is a name several peers may share (a LAN island); one without a name is its
        # own. This node's island counts once, whether or not a peer shares it.
        own = ns.get("island") or ns["peer_id"]
        islands = {x.get("island") or x["peer_id"] for x in peers} | {own}
        relayed = sum(1 for x in peers if x["reachability"] == "relayed")
        up, down, up_rate, down_rate = self._bandwidth()
        snap = DashboardSnapshot(
            peer_id=ns["peer_id"],
            run_id=ns["run_id"],
            run_name=ns["run_name"],
            model=ns["model"],
            state="connecting" if self.running is None else "idle",
            peers_direct=len(peers) - relayed,
            peers_relayed=relayed,
            islands=len(islands),
            reachability=ns["reachability"],
            bytes_up=up,
            bytes_down=down,
            up_rate=up_rate,
            down_rate=down_rate,
            events=list(ns.get("events", ())),
        )
        if self.running is None:
            return snap
        rv, tv = self.running.views()
        snap.version = rv.version
        snap.paused_reason = rv.paused_reason
        snap.stalled = rv.stalled
        phase = "paused" if rv.paused_reason else tv.phase if tv is not None else rv.phase
        snap.state = _STATES.get(phase, "idle" if phase.startswith("idle") else phase)
        fragments = self.running.manifest.outer.fragments
        H = self.running.manifest.inner_steps // fragments  # steps per delta
        snap.fragments, snap.fragment = fragments, round_fragment(rv.version, fragments)
        now = time.monotonic()
        if tv is not None:
            H = tv.stretch_steps or H
            snap.inner_step = min(tv.inner_step, H)
            snap.overtime_steps = tv.overtime
            if tv.due_s is not None:  # counts down between the trainer's steps
                snap.eta_seconds = max(0.0, tv.due_s - (now - tv.published_at))
            snap.tokens_per_second = tv.tokens_per_second
            snap.utilization = tv.utilization
            snap.loss_local = list(tv.losses)
            snap.late_reasons = dict(tv.late)
            snap.late = sum(snap.late_reasons.values())
        if rv.waiting_since is not None:
            snap.waiting_on = f"certificate for version {rv.version + 1}"
            snap.waiting_seconds = max(0.0, now - rv.waiting_since)
        snap.inner_steps = H
        snap.loss_global = list(rv.eval_losses)
        if rv.on_committee:
            role = "leader" if rv.committee[0] == ns["peer_id"] else "member"
            snap.committee_duty = f"syncer ({role}) for version {rv.committee_version}"
        elif rv.committee:
            snap.committee_duty = f"none for version {rv.committee_version}"
        snap.accepted, snap.rejected = rv.accepted, rv.rejected  # as certified (the leaderboard)
        snap.uncredited = rv.uncredited
        snap.rejected_reasons = dict(rv.rejected_reasons)
        snap.tokens_contributed = rv.tokens_accepted
        snap.share, snap.rank, snap.ranked_peers = rv.share, rv.rank, rv.ranked_peers
        events = sorted([*rv.events, *(tv.events if tv is not None else ())])
        snap.events = events[-5:] or snap.events
        return snap

    def metrics(self) -> dict[str, Any]:
        """Flat numbers for ``node_metrics`` (Prometheus) and ``/api/v1/state``."""
        snap = self.snapshot()
        tv = self.running.views()[1] if self.running is not None else None
        return {
            "peer_id": snap.peer_id,
            "run_id": snap.run_id,
            "state": snap.state,
            "version": snap.version,
            "tokens_per_second": snap.tokens_per_second,
            "tokens_trained": tv.tokens_trained if tv is not None else 0,
            "tokens_accepted": snap.tokens_contributed,
            "sent": tv.sent if tv is not None else 0,
            "accepted": snap.accepted,
            "rejected": snap.rejected,
            "late": snap.late,
            "rounds": snap.version,
            "bytes_up": snap.bytes_up,
            "bytes_down": snap.bytes_down,
            "peers_direct": snap.peers_direct,
            "peers_relayed": snap.peers_relayed,
            "on_committee": self.running is not None and self.running.views()[0].on_committee,
            "stalled": snap.stalled,  # None, or "stalled: no certificate for version ..."
            "stalled_seconds": self.running.views()[0].stalled_s if self.running else 0.0,
        }
