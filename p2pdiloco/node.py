"""A node of the network: wires identity, DHT, gossip and membership together.

At this stage a node joins a run, checks its reachability, publishes signed heartbeats (DHT and
gossip), keeps the run's manifest alive, and tracks the run's members through both paths until
stopped. Training in the network builds on this loop.

Gossip only accelerates: every heartbeat is also stored in the DHT and the DHT is polled every
interval, so with gossip off (``gossip=False``) or dead, membership still converges.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pdiloco.errors import UserError
from p2pdiloco.net import keys
from p2pdiloco.net.cert_records import cert_topic
from p2pdiloco.net.dht import DHTPlane, NetworkError
from p2pdiloco.net.discovery import RunInfo, choose_run, read_bootstraps, read_peers, read_runs
from p2pdiloco.net.gossip import GossipError, GossipMessage, GossipProcess
from p2pdiloco.net.manifests import publish_manifest
from p2pdiloco.net.membership import Membership
from p2pdiloco.net.p2p_bridge import P2PBridge
from p2pdiloco.net.reachability import Reachability, ask_dialback, classify
from p2pdiloco.protocol.identity import Identity, default_identity_path
from p2pdiloco.protocol.records import Hardware, Heartbeat
from p2pdiloco.protocol.signing import InvalidRecord, open_envelope, seal

log = logging.getLogger(__name__)


def run_topic(run_id: str) -> str:
    return f"{keys.PREFIX}/run/{run_id}"


@dataclass
class NodeConfig:
    """Settings of one node (the ``join`` flags map onto these)."""

    bootstrap: list[str]  # bootstrap multiaddrs, already resolved (flags > env > config > list)
    model: str | None = None  # pick the most active run for this model ...
    run: str | None = None  # ... or join this run id
    identity: Path | None = None  # key file; default: the XDG data path
    host: str = "0.0.0.0"
    port: int = 0  # DHT TCP port (gossip uses port + 1 when fixed)
    announce: list[str] = field(default_factory=list)
    island: str = ""  # island name; default: the host name
    gossip: bool = True  # False: DHT only (gossip is an accelerator)
    heartbeat_interval: float = keys.HEARTBEAT_INTERVAL
    heartbeat_ttl: float = keys.HEARTBEAT_TTL


class Node:
    """Use as a context manager, or ``start()`` then ``close()``."""

    def __init__(self, cfg: NodeConfig) -> None:
        if not cfg.bootstrap:
            raise UserError(
                "no bootstrap server configured: pass --bootstrap ADDR, set P2PDILOCO_BOOTSTRAP, "
                "or add bootstrap = [...] to ~/.config/p2pdiloco/config.toml"
            )
        self.cfg = cfg
        self.identity = Identity.load_or_create(cfg.identity or default_identity_path())
        self.island = cfg.island or platform.node() or "island"
        self.dht: DHTPlane | None = None
        self.gossip: GossipProcess | None = None
        self.bridge: P2PBridge | None = None
        self.run: RunInfo | None = None
        self.members: Membership | None = None
        self.reachability = Reachability("unknown", "not checked yet")
        self.version = 0
        self.throughput_tps = 0.0
        self.rejected = 0
        self._seq = 0
        self._gossip_dialed: set[str] = set()
        self._gossip_retry_at: dict[str, float] = {}  # failed dials wait before the next try
        self._ticks = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.events: list[str] = []
        self.roles: list[str] = ["learner"]
        # Gossip messages of other topics (certificates) go to this callback, from the node thread.
        self.on_gossip: Callable[[GossipMessage], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Join: DHT, run choice, gossip, reachability, then the heartbeat loop.

        Raises NetworkError when no bootstrap is reachable (naming what was tried), UserError
        when no compatible run exists.
        """
        cfg = self.cfg
        self.dht = DHTPlane(
            self.identity,
            initial_peers=cfg.bootstrap,
            host=cfg.host,
            port=cfg.port,
            announce=cfg.announce,
            identity_path=cfg.identity or default_identity_path(),
        )
        self.run = self._find_run()
        self.members = Membership(run_id=self.run.run_id, ttl=cfg.heartbeat_ttl)
        self._event(f"joined run {self.run.manifest.name} ({self.run.run_id[:12]})")
        if cfg.gossip:
            self._start_gossip()
        self.bridge = P2PBridge(self.dht.dht)
        self.reachability = self._check_reachability()
        self._event(f"reachability: {self.reachability.status}: {self.reachability.detail}")
        if self.reachability.fix:
            log.warning("relayed: %s", self.reachability.fix)
        self._tick()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="node")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for part in (self.gossip, self.bridge, self.dht):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.exception("error while stopping %s", type(part).__name__)
        self.gossip = self.bridge = self.dht = None

    def __enter__(self) -> Node:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- steps -------------------------------------------------------------------------------

    def _find_run(self) -> RunInfo:
        assert self.dht is not None
        runs, _ = read_runs(self.dht, None if self.cfg.run else self.cfg.model)
        if self.cfg.run:
            match = [r for r in runs if r.run_id.startswith(self.cfg.run)]
            if not match:
                raise UserError(f"run '{self.cfg.run}' not found in the DHT")
            if match[0].incompatible:
                raise UserError(match[0].incompatible)
            run = match[0]
        else:
            for r in runs:
                if not r.incompatible:
                    r.peers = read_peers(self.dht, r.run_id)
            run = choose_run(runs, self.cfg.model or "")
        # Re-publish the manifest: a run stays discoverable while any member is alive.
        try:
            publish_manifest(self.dht, run.run_id, run.manifest, run.raw)
        except NetworkError as e:
            log.warning("could not re-publish the run manifest: %s", e)
        return run

    def _start_gossip(self) -> None:
        assert self.run is not None
        port = self.cfg.port + 1 if self.cfg.port else 0
        gossip = GossipProcess(
            self.identity.seed,
            topics=[run_topic(self.run.run_id), cert_topic(self.run.run_id)],
            listen_host=self.cfg.host,
            port=port,
        )
        try:
            gossip.start()
        except GossipError as e:
            log.warning("gossip unavailable (%s); continuing with DHT polling only", e)
            return
        self.gossip = gossip

    def _check_reachability(self) -> Reachability:
        assert self.dht is not None and self.bridge is not None
        ports = sorted(
            {
                int(a.split("/tcp/")[1].split("/")[0])
                for a in self.dht.visible_maddrs()
                if "/tcp/" in a
            }
        )
        replies = []
        for v in read_bootstraps(self.dht).live(time.time())[:3]:
            try:
                replies.append(self.bridge.run(ask_dialback(self.bridge.p2p, v.peer_id, ports), 15))
            except Exception as e:
                log.info("dial-back via %s failed: %s", v.peer_id, e)
        return classify(replies, ports)

    def _heartbeat(self) -> bytes:
        assert self.dht is not None and self.run is not None
        self._seq += 1
        hb = Heartbeat(
            peer_id=self.identity.peer_id,
            island=self.island[:64],
            roles=list(self.roles),  # type: ignore[arg-type]
            hardware=_hardware(),
            throughput_tps=self.throughput_tps,
            version=self.version,
            addrs=self.dht.visible_maddrs()[:16],
            gossip_addrs=(self.gossip.maddrs if self.gossip and self.gossip.alive else [])[:16],
            reachability=self.reachability.status,  # type: ignore[arg-type]
            seq=self._seq,
        )
        return seal(self.identity, "heartbeat", self.run.run_id, hb.model_dump(mode="json"))

    def _tick(self) -> None:
        """One interval: publish, poll the DHT, drain gossip, expire, dial new gossip peers."""
        assert self.dht is not None and self.run is not None and self.members is not None
        self.dht.rejoin(self.cfg.bootstrap)
        raw = self._heartbeat()
        self.dht.store(
            keys.run_peers_key(self.run.run_id), self.identity.peer_id, raw, self.cfg.heartbeat_ttl
        )
        if self.gossip is not None and self.gossip.alive:
            try:
                self.gossip.publish(run_topic(self.run.run_id), raw)
            except GossipError as e:
                log.warning("gossip publish failed: %s", e)
        for rec in self.dht.read(
            keys.run_peers_key(self.run.run_id), kind="heartbeat", run_id=self.run.run_id
        ):
            self._ingest(rec.envelope.raw, "dht", rec.subkey)
        self._drain_gossip()
        with self._lock:
            for gone in self.members.expire(time.time()):
                self._event(
                    f"peer {gone[:16]} left (no heartbeat for {self.cfg.heartbeat_ttl:.0f}s)"
                )
        self._dial_gossip_peers()

    def _drain_gossip(self) -> None:
        if self.gossip is None:
            return
        assert self.run is not None
        while (msg := self.gossip.get(timeout=0)) is not None:
            if msg.topic == run_topic(self.run.run_id):
                self._ingest(msg.data, "gossip", msg.from_peer)
            elif self.on_gossip is not None:
                try:
                    self.on_gossip(msg)
                except Exception:
                    log.exception("gossip message on %s failed", msg.topic)

    def _ingest(self, raw: bytes, via: str, sender: str) -> None:
        assert self.members is not None and self.run is not None
        try:
            env = open_envelope(raw, kind="heartbeat", run_id=self.run.run_id)
            with self._lock:
                new_peer = env.signer not in self.members.peers
                self.members.ingest(env, via=via)
            if new_peer and env.signer != self.identity.peer_id:
                self._event(f"peer {env.signer[:16]} joined (via {via})")
        except InvalidRecord as e:
            self.rejected += 1
            log.warning("dropped heartbeat from %s via %s: %s", e.signer or sender, via, e)

    def _dial_gossip_peers(self) -> None:
        if self.gossip is None or not self.gossip.alive or self.dht is None:
            return
        targets: list[tuple[str, list[str]]] = []
        with self._lock:
            assert self.members is not None
            targets += [
                (v.peer_id, list(v.heartbeat.gossip_addrs)) for v in self.members.peers.values()
            ]
        self._ticks += 1
        if self._ticks % 6 == 1:  # bootstrap servers change rarely: look them up every ~30 s
            targets += [
                (v.peer_id, list(v.heartbeat.gossip_addrs))
                for v in read_bootstraps(self.dht).peers.values()
            ]
        now = time.monotonic()
        for peer_id, addrs in targets:
            if peer_id == self.identity.peer_id or peer_id in self._gossip_dialed or not addrs:
                continue
            if self._gossip_retry_at.get(peer_id, 0.0) > now:
                continue
            if any(self.gossip.connect(addr, timeout=5) for addr in addrs[:4]):
                self._gossip_dialed.add(peer_id)
                self._gossip_retry_at.pop(peer_id, None)
            else:  # unreachable for now (relayed, firewalled): DHT polling still covers it
                self._gossip_retry_at[peer_id] = now + 60.0

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_interval):
            try:
                self._tick()
            except Exception:  # a failing interval is logged and retried, never fatal
                log.exception("heartbeat interval failed")

    def _event(self, text: str) -> None:
        log.info(text)
        self.events = (self.events + [f"{time.strftime('%H:%M:%S')} {text}"])[-50:]

    # -- views -------------------------------------------------------------------------------

    def peer_addrs(self, peer_id: str) -> list[str]:
        """DHT-side multiaddrs of a live member (from its heartbeat); [] if unknown."""
        with self._lock:
            view = self.members.peers.get(peer_id) if self.members else None
            return list(view.heartbeat.addrs) if view is not None else []

    def peers_holding(self, version: int) -> list[tuple[str, list[str]]]:
        """Live members that announce ``version`` or newer, with their addresses."""
        now = time.time()
        with self._lock:
            live = self.members.live(now) if self.members else []
        return [
            (v.peer_id, list(v.heartbeat.addrs))
            for v in live
            if v.peer_id != self.identity.peer_id and v.heartbeat.version >= version
        ]

    def snapshot(self) -> dict[str, Any]:
        """A plain-data view for status lines and the dashboard."""
        now = time.time()
        with self._lock:
            live = self.members.live(now) if self.members else []
        return {
            "peer_id": self.identity.peer_id,
            "run_id": self.run.run_id if self.run else None,
            "run_name": self.run.manifest.name if self.run else None,
            "model": self.run.manifest.model if self.run else None,
            "version": self.version,
            "reachability": self.reachability.status,
            "peers": [
                {
                    "peer_id": v.peer_id,
                    "via": v.via,
                    "reachability": v.heartbeat.reachability,
                    "island": v.heartbeat.island,
                }
                for v in live
            ],
            "gossip": bool(self.gossip and self.gossip.alive),
            "rejected": self.rejected,
        }


def _hardware() -> Hardware:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Hardware(
            device="cuda",
            name=props.name[:64],
            memory_gb=round(props.total_memory / 2**30, 1),
            count=torch.cuda.device_count(),
        )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Hardware(
        device="cpu",
        name=(platform.processor() or platform.machine())[:64],
        memory_gb=round(mem, 1),
        count=os.cpu_count() or 1,
    )
