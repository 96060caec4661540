"""A node of the network: identity, DHT, gossip and membership; the runtime's real ``Plane``.

``start()`` (blocking, before the runtime runs) joins a run: DHT, run choice, gossip,
reachability. From then on the runtime's loop calls ``tick(presence)`` every heartbeat
interval: the DHT and gossip I/O runs in a worker thread, and the membership it returns is
changed on the loop only, so the loop is the one owner of the node's state. Certificates heard
on gossip are handed back to the runtime from ``tick``. ``view`` is an immutable snapshot for
other threads (dashboard, log lines), replaced after each tick.

Gossip only accelerates: every heartbeat is also stored in the DHT and the DHT is polled every
interval, so with gossip off (``gossip=False``) or dead, membership still converges.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from p2pdiloco.aio import off_loop as _off_loop
from p2pdiloco.errors import UserError
from p2pdiloco.net import keys, known_peers
from p2pdiloco.net.cert_records import (
    cert_topic,
    publish_certificate,
    read_certificates,
    store_certificate,
)
from p2pdiloco.net.dht import DHTPlane, NetworkError
from p2pdiloco.net.discovery import (
    RunInfo,
    RunNotFound,
    choose_run,
    read_bootstraps,
    read_peers,
    read_runs,
)
from p2pdiloco.net.gossip import GossipError, GossipMessage, GossipProcess
from p2pdiloco.net.local_runs import LocalRun, local_run_by_id, newest_local_run, read_local_runs
from p2pdiloco.net.manifests import publish_manifest
from p2pdiloco.net.membership import Membership
from p2pdiloco.net.p2p_bridge import P2PBridge
from p2pdiloco.net.plane import Presence
from p2pdiloco.net.reachability import Reachability, ask_dialback, classify
from p2pdiloco.net.republish import interval_index, republishes
from p2pdiloco.protocol.certificates import Certificate
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
    island: str = ""  # island name; default: "island-" and the peer id's last 6 characters
    gossip: bool = True  # False: DHT only (gossip is an accelerator)
    heartbeat_interval: float = keys.HEARTBEAT_INTERVAL
    heartbeat_ttl: float = keys.HEARTBEAT_TTL
    # Where to remember the peers heard from (net.known_peers), dialled beside the bootstrap
    # servers at the next start; None: remember nothing.
    known_peers: Path | None = None
    # Seconds to keep looking for the run before giving up: a DHT that a restarted bootstrap
    # only begins to refill may not answer at once.
    run_lookup_s: float = 20.0
    # Signed manifests kept on this machine (``net.local_runs``): the run is taken from them
    # when the DHT has forgotten it, and published again.
    local_manifests: tuple[Path, ...] = ()


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
        # Published in every heartbeat: never the host name (issue 39), one per identity.
        self.island = cfg.island or f"island-{self.identity.peer_id[-6:]}"
        self.dht: DHTPlane | None = None
        self.gossip: GossipProcess | None = None
        self.bridge: P2PBridge | None = None
        self.run: RunInfo | None = None
        self.members: Membership | None = None
        self.me = self.identity.peer_id
        self.reachability = Reachability("unknown", "not checked yet")
        self.run_note = ""  # one line when the run came from a manifest on disk, not the DHT
        self._newest_cert: Certificate | None = None  # owned by the loop; handed to _io when drawn
        self.rejected = 0
        self._seq = 0
        self._gossip_dialed: set[str] = set()
        self._gossip_retry_at: dict[str, float] = {}  # failed dials wait before the next try
        self._gossip_restarts = 0  # restarts of the gossip child seen by the dialer
        self._ticks = 0
        self._remember_ticks = 0
        self._remembered: frozenset[str] = frozenset()  # peer ids in the known-peers file
        self.events: list[str] = []
        self.view: dict[str, object] = {}  # immutable snapshot for other threads (see snapshot)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Join: DHT, run choice, gossip, reachability, then the heartbeat loop.

        Raises NetworkError when no bootstrap is reachable (naming what was tried), UserError
        when no compatible run exists.
        """
        cfg = self.cfg
        remembered = known_peers.load(cfg.known_peers, self.me) if cfg.known_peers else []
        if remembered:
            log.info(
                "also dialling %d peer(s) remembered from earlier runs (%s)",
                len(remembered),
                cfg.known_peers,
            )
        self.dht = DHTPlane(
            self.identity,
            initial_peers=known_peers.initial_peers(cfg.bootstrap, remembered),
            host=cfg.host,
            port=cfg.port,
            announce=cfg.announce,
            identity_path=cfg.identity or default_identity_path(),
        )
        self.run = self._find_run()
        self.members = Membership(run_id=self.run.run_id, ttl=cfg.heartbeat_ttl)
        self._event(f"joined run {self.run.manifest.name} ({self.run.run_id[:12]})")
        # The gossip child starts (a new interpreter: seconds) while reachability is checked.
        gossip = self._gossip_process() if cfg.gossip else None
        starting = threading.Thread(
            target=self._start_gossip, args=(gossip,), name="p2pdiloco-gossip-start", daemon=True
        )
        if gossip is not None:
            starting.start()
        try:
            self.bridge = P2PBridge(self.dht.dht)
            self.reachability = self._check_reachability()
            if gossip is not None:
                starting.join()
        except BaseException:
            if gossip is not None:  # interrupted: the start gives up at once, the child stops
                gossip.close()
                starting.join()
            raise
        self._event(f"reachability: {self.reachability.status}: {self.reachability.detail}")
        if self.reachability.fix:
            log.warning("relayed: %s", self.reachability.fix)
        self._apply(self._io(Presence(0, ("learner",), 0.0)))

    def close(self) -> None:
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
        """The run to join, from the DHT, else from a signed manifest kept on disk.

        With ``--run`` and a kept copy of its manifest, the DHT is asked once: the copy is the
        run (its id is its hash). With ``--model`` and a kept run of that model, the DHT is
        asked for one heartbeat interval (its live members store the run again within one),
        then the newest kept run is resumed. Without a kept copy the DHT is asked for up to
        ``run_lookup_s``. A run taken from disk is published again and ``run_note`` says so."""
        cfg = self.cfg
        local = read_local_runs(cfg.local_manifests)
        kept, count = None, 0
        if cfg.run:
            kept = local_run_by_id(local, cfg.run)
            patience = 0.0 if kept else cfg.run_lookup_s
        else:
            kept, count = newest_local_run(local, cfg.model or "")
            patience = min(cfg.heartbeat_interval, cfg.run_lookup_s) if kept else cfg.run_lookup_s
        try:
            return self._look_up_run(patience)
        except RunNotFound:
            if kept is None:
                raise
        self.run_note = _kept_run_note(kept, cfg.run, cfg.model, count)
        self._publish_manifest(kept.info)
        return kept.info

    def _look_up_run(self, patience: float) -> RunInfo:
        """The run from the DHT; looks again for up to ``patience`` seconds while it is not
        found (a restarted bootstrap's DHT fills as the peers rejoin it, within a heartbeat
        interval)."""
        deadline = time.monotonic() + patience
        pause = 2.0
        while True:
            try:
                return self._find_run_once()
            except RunNotFound as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.info("%s; looking again for up to %.0f s", e, left)
                time.sleep(min(pause, left))
                pause *= 2

    def _find_run_once(self) -> RunInfo:
        assert self.dht is not None
        runs, _ = read_runs(self.dht, None if self.cfg.run else self.cfg.model)
        if self.cfg.run:
            match = [r for r in runs if r.run_id.startswith(self.cfg.run)]
            if not match:
                raise RunNotFound(f"run '{self.cfg.run}' not found in the DHT")
            if match[0].incompatible:
                raise UserError(match[0].incompatible)
            run = match[0]
        else:
            for r in runs:
                if not r.incompatible:
                    r.peers = read_peers(self.dht, r.run_id)
            run = choose_run(runs, self.cfg.model or "")
        self._publish_manifest(run)
        return run

    def _publish_manifest(self, run: RunInfo) -> None:
        """Store the run's signed manifest again (fresh expiry): a run stays discoverable while
        any member is alive."""
        assert self.dht is not None
        try:
            publish_manifest(self.dht, run.run_id, run.manifest, run.raw)
        except NetworkError as e:
            log.warning("could not re-publish the run manifest: %s", e)

    def _gossip_process(self) -> GossipProcess:
        assert self.run is not None
        return GossipProcess(
            self.identity.seed,
            topics=[run_topic(self.run.run_id), cert_topic(self.run.run_id)],
            listen_host=self.cfg.host,
            port=self.cfg.port + 1 if self.cfg.port else 0,
        )

    def _start_gossip(self, gossip: GossipProcess) -> None:
        """In its own thread during ``start``: ``self.gossip`` once its child listens."""
        try:
            gossip.start()
        except Exception as e:  # GossipError, or the OS refusing a process: never fatal
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

    def _heartbeat(self, presence: Presence) -> bytes:
        assert self.dht is not None and self.run is not None
        self._seq += 1
        hb = Heartbeat(
            peer_id=self.identity.peer_id,
            island=self.island[:64],
            roles=list(presence.roles),  # type: ignore[arg-type]
            hardware=_hardware(),
            throughput_tps=max(0.0, presence.throughput_tps),
            version=presence.version,
            addrs=announced_addrs(self.dht.visible_maddrs())[:16],
            gossip_addrs=announced_addrs(
                self.gossip.maddrs if self.gossip and self.gossip.alive else []
            )[:16],
            reachability=self.reachability.status,  # type: ignore[arg-type]
            seq=self._seq,
            stalled_s=round(max(0.0, presence.stalled_s), 1),
        )
        return seal(self.identity, "heartbeat", self.run.run_id, hb.model_dump(mode="json"))

    # -- the plane (called on the runtime's loop) --------------------------------------------

    async def tick(self, presence: Presence) -> list[bytes]:
        """One interval: the DHT/gossip I/O in a worker thread, then membership on the loop;
        returns certificate bytes heard on gossip."""
        again = self._drawn_to_republish()
        cert = self._newest_cert if again else None
        heard = self._apply(await _off_loop(self._io, presence, again, cert))
        await _off_loop(self._dial_gossip_peers, self._gossip_targets())
        await self._remember_peers()
        return heard

    async def _remember_peers(self) -> None:
        """Write the live peers' DHT addresses for the next start when the set changed, and
        every ~minute to refresh when they were seen."""
        if self.cfg.known_peers is None or self.members is None:
            return
        live = self.members.live(time.time())
        ids = frozenset(v.peer_id for v in live)
        self._remember_ticks += 1
        if ids == self._remembered and self._remember_ticks % 12:
            return
        self._remembered = ids
        peers = [known_peers.KnownPeer(v.peer_id, tuple(v.heartbeat.addrs), v.ts) for v in live]
        await _off_loop(known_peers.save, self.cfg.known_peers, peers, self.me)

    def _drawn_to_republish(self) -> bool:
        """Whether this node stores the run's manifest and its newest certificate again this
        interval (``net.republish``: a few live members per interval, drawn afresh)."""
        live = self.members.live(time.time()) if self.members else []
        index = interval_index(time.time(), self.cfg.heartbeat_interval)
        return republishes(self.me, [v.peer_id for v in live], index)

    def _io(
        self, presence: Presence, republish: bool = False, cert: Certificate | None = None
    ) -> tuple[list[tuple[bytes, str, str]], list[GossipMessage]]:
        """Publish our heartbeat (and, when drawn to ``republish``, the run's manifest and
        ``cert``, our newest certificate, again); read the run's heartbeats and drain gossip
        (worker thread: touches no membership state)."""
        assert self.dht is not None and self.run is not None
        self.dht.rejoin(self.cfg.bootstrap)
        raw = self._heartbeat(presence)
        self.dht.store(
            keys.run_peers_key(self.run.run_id), self.identity.peer_id, raw, self.cfg.heartbeat_ttl
        )
        if republish:
            try:
                publish_manifest(self.dht, self.run.run_id, self.run.manifest, self.run.raw)
            except NetworkError as e:  # no DHT peer reachable now: the next draw tries again
                log.info("storing the run manifest again failed: %s", e)
            if cert is not None:
                store_certificate(self.identity, self.run.run_id, cert, self.dht)
        if self.gossip is not None and self.gossip.alive:
            try:
                self.gossip.publish(run_topic(self.run.run_id), raw)
            except GossipError as e:
                log.warning("gossip publish failed: %s", e)
        records = [
            (rec.envelope.raw, "dht", rec.subkey)
            for rec in self.dht.read(
                keys.run_peers_key(self.run.run_id), kind="heartbeat", run_id=self.run.run_id
            )
        ]
        messages = []
        while self.gossip is not None and (msg := self.gossip.get(timeout=0)) is not None:
            messages.append(msg)
        return records, messages

    def _apply(
        self, collected: tuple[list[tuple[bytes, str, str]], list[GossipMessage]]
    ) -> list[bytes]:
        assert self.run is not None and self.members is not None
        records, messages = collected
        heard = []
        for raw, via, sender in records:
            self._ingest(raw, via, sender)
        for msg in messages:
            if msg.topic == run_topic(self.run.run_id):
                self._ingest(msg.data, "gossip", msg.from_peer)
            elif msg.topic == cert_topic(self.run.run_id) and len(msg.data) < (1 << 20):
                heard.append(bytes(msg.data))
        for gone in self.members.expire(time.time()):
            self._event(f"peer {gone[:16]} left (no heartbeat for {self.cfg.heartbeat_ttl:.0f}s)")
        self.view = self._snapshot()
        return heard

    def _ingest(self, raw: bytes, via: str, sender: str) -> None:
        assert self.members is not None and self.run is not None
        try:
            env = open_envelope(raw, kind="heartbeat", run_id=self.run.run_id)
            new_peer = env.signer not in self.members.peers
            self.members.ingest(env, via=via)
            if new_peer and env.signer != self.identity.peer_id:
                self._event(f"peer {env.signer[:16]} joined (via {via})")
        except InvalidRecord as e:
            self.rejected += 1
            log.warning("dropped heartbeat from %s via %s: %s", e.signer or sender, via, e)

    def _gossip_targets(self) -> list[tuple[str, list[str]]]:
        if self.gossip is None or not self.gossip.alive or self.dht is None:
            return []
        assert self.members is not None
        targets = [(v.peer_id, list(v.heartbeat.gossip_addrs)) for v in self.members.peers.values()]
        self._ticks += 1
        if self._ticks % 6 == 1:  # bootstrap servers change rarely: look them up every ~30 s
            targets += [
                (v.peer_id, list(v.heartbeat.gossip_addrs))
                for v in read_bootstraps(self.dht).peers.values()
            ]
        now = time.monotonic()
        return [
            (peer_id, addrs)
            for peer_id, addrs in targets
            if peer_id != self.identity.peer_id
            and peer_id not in self._gossip_dialed
            and addrs
            and self._gossip_retry_at.get(peer_id, 0.0) <= now
        ]

    async def publish_certificate(self, cert: Certificate) -> None:
        assert self.run is not None
        if self._newest_cert is None or cert.body.version > self._newest_cert.body.version:
            self._newest_cert = cert
        await _off_loop(
            publish_certificate, self.identity, self.run.run_id, cert, self.dht, self.gossip
        )

    async def read_certificates(self) -> list[bytes]:
        if self.dht is None or self.run is None:
            return []
        return await _off_loop(read_certificates, self.dht, self.run.run_id)

    def _dial_gossip_peers(self, targets: list[tuple[str, list[str]]]) -> None:
        """Dial new gossip peers (worker thread; the dial bookkeeping is touched only here)."""
        if self.gossip is None or not self.gossip.alive:
            return
        if self.gossip.restarts != self._gossip_restarts:  # a new child knows no one: redial
            self._gossip_restarts = self.gossip.restarts
            self._gossip_dialed.clear()
            self._gossip_retry_at.clear()
        with contextlib.suppress(GossipError):  # a peer whose child restarted dropped us
            self._gossip_dialed.intersection_update(self.gossip.peers(timeout=2.0))
        now = time.monotonic()
        for peer_id, addrs in targets:
            try:
                reached = any(self.gossip.connect(addr, timeout=5) for addr in addrs[:4])
            except GossipError:  # the child died mid-dial (restarted, or stopping): next tick
                return
            if reached:
                self._gossip_dialed.add(peer_id)
                self._gossip_retry_at.pop(peer_id, None)
            else:  # unreachable for now (relayed, firewalled): DHT polling still covers it
                self._gossip_retry_at[peer_id] = now + 60.0

    def _event(self, text: str) -> None:
        log.info(text)
        self.events = (self.events + [f"{time.strftime('%H:%M:%S')} {text}"])[-50:]

    # -- views (on the loop) ------------------------------------------------------------------

    def peer_addrs(self, peer_id: str) -> list[str]:
        """DHT-side multiaddrs of a live member (from its heartbeat); [] if unknown."""
        view = self.members.peers.get(peer_id) if self.members else None
        return list(view.heartbeat.addrs) if view is not None else []

    def peers_holding(self, version: int) -> list[str]:
        """Live members that announce ``version`` or newer."""
        live = self.members.live(time.time()) if self.members else []
        return [
            v.peer_id
            for v in live
            if v.peer_id != self.identity.peer_id and v.heartbeat.version >= version
        ]

    def live_learners(self) -> list[str]:
        live = self.members.live(time.time()) if self.members else []
        others = [
            v.peer_id for v in live if v.peer_id != self.me and "learner" in v.heartbeat.roles
        ]
        return [self.me, *others]

    def snapshot(self) -> dict[str, object]:
        """The newest plain-data view (safe from any thread: replaced, never mutated)."""
        return self.view

    def _snapshot(self) -> dict[str, object]:
        live = self.members.live(time.time()) if self.members else []
        return {
            "peer_id": self.identity.peer_id,
            "run_id": self.run.run_id if self.run else None,
            "run_name": self.run.manifest.name if self.run else None,
            "model": self.run.manifest.model if self.run else None,
            "reachability": self.reachability.status,
            "island": self.island,
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
            "gossip_restarts": self.gossip.restarts if self.gossip else 0,
            "rejected": self.rejected,
            "events": tuple(self.events[-5:]),
        }


def announced_addrs(addrs: list[str]) -> list[str]:
    """The addresses a heartbeat announces (DHT and gossip): the host's, less loopback ones (of use to no
    other machine, they only describe this one) unless it listens on loopback alone. LAN
    addresses stay: peers on the same LAN dial them (``--announce`` publishes only those
    given)."""
    loopback = ("/ip4/127.", "/ip6/::1/")
    others = [a for a in addrs if not a.startswith(loopback)]
    return others or addrs


def _kept_run_note(kept: LocalRun, run: str | None, model: str | None, count: int) -> str:
    """The one line saying that the run was taken from a manifest kept on disk."""
    where = f"{kept.info.manifest.name} ({kept.info.run_id[:12]})"
    if run:
        return (
            f"run '{run}' is not in the DHT: joining {where} from its signed manifest in "
            f"{kept.path}, and publishing it again"
        )
    others = f" (the newest of {count}; pass --run ID for another)" if count > 1 else ""
    return (
        f"no run for model '{model}' in the DHT: resuming {where} from its signed manifest in "
        f"{kept.path}{others}, and publishing it again"
    )


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
