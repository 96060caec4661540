"""Reading the network's state from the DHT: runs, their peers, bootstrap servers.

Shared by ``p2pdiloco status``, the bootstrap's ``/api/v1/state`` and ``join``'s run choice.
Every record is verified by ``DHTPlane.read``; a manifest whose recomputed run id differs from the
subkey it is stored under, or whose protocol version we do not speak, is reported, not used.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from p2pdiloco.errors import UserError
from p2pdiloco.net import keys
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.net.membership import Membership
from p2pdiloco.protocol.records import (
    Heartbeat,
    IncompatibleProtocol,
    RunManifest,
    parse_manifest,
)
from p2pdiloco.protocol.signing import InvalidRecord

log = logging.getLogger(__name__)


@dataclass
class RunInfo:
    run_id: str
    manifest: RunManifest
    peers: Membership | None = None
    incompatible: str = ""  # why this node cannot join it, if it cannot
    raw: bytes = b""  # the verified signed manifest, for re-publishing as it is

    def summary(self, now: float) -> dict[str, Any]:
        if self.incompatible:  # an unvalidated body from another protocol: show little of it
            return _incompatible_summary(self)
        live = self.peers.live(now) if self.peers else []
        return {
            "run_id": self.run_id,
            "name": self.manifest.name,
            "model": self.manifest.model,
            "data": self.manifest.data,
            "creator": self.manifest.creator,
            "protocol_version": self.manifest.protocol_version,
            "committee_size": self.manifest.committee_size,
            "quorum": self.manifest.quorum,
            "peers": len(live),
            "latest_version": max((v.heartbeat.version for v in live), default=0),
            "throughput_tps": sum(v.heartbeat.throughput_tps for v in live),
            "stalled": run_stall([v.heartbeat for v in live]),
            "incompatible": self.incompatible or None,
        }


def run_stall(live: list[Heartbeat]) -> str | None:
    """``no certificate for version N for S s (k of m live peers waiting)`` when at least half
    of a run's live peers announce that they have waited past the run's stall threshold; None
    while it certifies. S is the median wait the waiting peers announce (a hint: heartbeats are
    signed claims, each peer speaks only for itself)."""
    waiting = sorted(hb.stalled_s for hb in live if hb.stalled_s > 0)
    if not waiting or 2 * len(waiting) < len(live):
        return None
    version = max(hb.version for hb in live) + 1
    seconds = waiting[len(waiting) // 2]
    return (
        f"no certificate for version {version} for {seconds:.0f} s "
        f"({len(waiting)} of {len(live)} live peers waiting)"
    )


@dataclass
class NetworkState:
    runs: list[RunInfo] = field(default_factory=list)
    bootstraps: Membership | None = None
    rejected: list[str] = field(default_factory=list)

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        peers = []
        for run in self.runs:
            for v in run.peers.live(now) if run.peers else []:
                hb = v.heartbeat
                peers.append(
                    {
                        "peer_id": v.peer_id,
                        "run_id": run.run_id,
                        "island": hb.island,
                        "roles": list(hb.roles),
                        "reachability": hb.reachability,
                        "version": hb.version,
                        "throughput_tps": hb.throughput_tps,
                        "stalled_s": hb.stalled_s,
                        "hardware": hb.hardware.model_dump(),
                        "addrs": list(hb.addrs),
                        "gossip_addrs": list(hb.gossip_addrs),
                        "last_seen_s": round(now - v.ts, 1),
                        "via": v.via,
                    }
                )
        boots = self.bootstraps.live(now) if self.bootstraps else []
        return {
            "time": now,
            "runs": [r.summary(now) for r in self.runs],
            "peers": peers,
            "bootstraps": [{"peer_id": v.peer_id, "addrs": list(v.heartbeat.addrs)} for v in boots],
            "rejected_records": self.rejected,
        }


def read_runs(dht: DHTPlane, model: str | None = None) -> tuple[list[RunInfo], list[str]]:
    """Verified manifests (for one model, or all); plus one line per rejected manifest."""
    key = keys.model_runs_key(model) if model else keys.runs_key()
    runs, rejected = [], []
    for rec in dht.read(key, kind="manifest", run_id=""):
        try:
            run_id, manifest = parse_manifest(rec.envelope)
            if run_id != rec.subkey:
                raise InvalidRecord(
                    f"manifest stored as run {rec.subkey[:12]} hashes to {run_id[:12]}",
                    signer=rec.envelope.signer,
                )
        except IncompatibleProtocol as e:
            runs.append(_incompatible(rec.subkey, rec.envelope, str(e)))
            continue
        except (InvalidRecord, UserError) as e:
            line = f"manifest {rec.subkey[:12]} from {rec.envelope.signer}: {e}"
            log.warning("dropped %s", line)
            rejected.append(line)
            continue
        runs.append(RunInfo(run_id, manifest, raw=rec.envelope.raw))
    return runs, rejected


def _incompatible_summary(run: RunInfo) -> dict[str, Any]:
    name = getattr(run.manifest, "name", None)
    version = getattr(run.manifest, "protocol_version", None)
    return {
        "run_id": run.run_id,
        "name": name[:64] if isinstance(name, str) and name.isprintable() else "?",
        "model": "?",
        "protocol_version": version if isinstance(version, int) else None,
        "peers": 0,
        "latest_version": 0,
        "throughput_tps": 0.0,
        "incompatible": run.incompatible,
    }


def _incompatible(run_id: str, env: Any, why: str) -> RunInfo:
    body = dict(env.body)
    body.setdefault("protocol_version", -1)
    manifest = RunManifest.model_construct(**body)
    return RunInfo(run_id, manifest, incompatible=why)


def _read_heartbeats(dht: DHTPlane, key: str, run_id: str, ttl: float) -> Membership:
    table = Membership(run_id=run_id, ttl=ttl)
    for rec in dht.read(key, kind="heartbeat", run_id=run_id):
        try:
            table.ingest(rec.envelope, via="dht")
        except (InvalidRecord, UserError) as e:
            log.warning("dropped heartbeat from %s: %s", rec.envelope.signer, e)
    return table


def read_peers(dht: DHTPlane, run_id: str, ttl: float = keys.HEARTBEAT_TTL) -> Membership:
    """The live members of ``run_id`` according to the DHT."""
    return _read_heartbeats(dht, keys.run_peers_key(run_id), run_id, ttl)


def read_bootstraps(dht: DHTPlane) -> Membership:
    """Bootstrap servers alive now (their heartbeats carry run id "")."""
    return _read_heartbeats(dht, keys.bootstraps_key(), "", keys.HEARTBEAT_TTL)


def collect_state(dht: DHTPlane) -> NetworkState:
    """Everything ``status`` shows: runs with their live peers, and bootstrap servers."""
    runs, rejected = read_runs(dht)
    for run in runs:
        if not run.incompatible:
            run.peers = read_peers(dht, run.run_id)
    return NetworkState(runs=runs, bootstraps=read_bootstraps(dht), rejected=rejected)


class RunNotFound(UserError):
    """No run matched (a run that exists but is incompatible is a plain UserError)."""


def choose_run(runs: list[RunInfo], model: str) -> RunInfo:
    """The most active compatible run for ``model``; UserError naming what was found if none."""
    candidates = [r for r in runs if r.manifest.model == model]
    usable = [r for r in candidates if not r.incompatible]
    if not usable:
        if candidates:
            raise UserError(candidates[0].incompatible)
        raise RunNotFound(
            f"no run for model '{model}' found in the DHT; start one with: "
            f"p2pdiloco run create --name NAME --model {model}"
        )
    now = time.time()
    return max(
        usable,
        key=lambda r: (len(r.peers.live(now)) if r.peers else 0, r.manifest.created_at, r.run_id),
    )
