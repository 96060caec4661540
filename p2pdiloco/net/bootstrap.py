"""``p2pdiloco bootstrap``: a long-lived public entry point of the network.

It holds no training state, only its identity key: a hivemind DHT node on a fixed port (relay
service on, so peers behind NAT stay reachable through it), a py-libp2p gossip host on the next
port, a dial-back service for reachability checks, and health/state/metrics over HTTP. It keeps
its peer id across restarts because the key lives on disk. A plain hivemind DHT client that knows
nothing of p2pdiloco can bootstrap from it: it is an ordinary DHT node that only refuses to
*store* values that are not p2pdiloco's signed envelopes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from p2pdiloco import __version__
from p2pdiloco.net import keys
from p2pdiloco.net.bootstrap_config import BootstrapConfig
from p2pdiloco.net.cert_records import cert_topic, fetch_cert, read_certificates, run_of_cert_topic
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.net.discovery import NetworkState, collect_state
from p2pdiloco.net.gossip import GossipError, GossipProcess
from p2pdiloco.net.http_api import HTTPApi
from p2pdiloco.net.observe import NetworkWatch, install_noise_filter
from p2pdiloco.net.p2p_bridge import P2PBridge
from p2pdiloco.net.reachability import serve_dialback
from p2pdiloco.net.sync_rpc import RpcError
from p2pdiloco.net.transport import P2PTransport, Transport
from p2pdiloco.net.web_page import render_page
from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.protocol.identity import Identity, default_identity_path
from p2pdiloco.protocol.records import Hardware, Heartbeat
from p2pdiloco.protocol.signing import InvalidRecord, seal

log = logging.getLogger(__name__)

ANNOUNCE_TOPIC = "p2pdiloco/v1/announce"


def read_gossip(gossip: GossipProcess, watch: NetworkWatch) -> None:
    """Drain what gossip brought. A bootstrap relays gossip; of what it hears it reads only
    certificates, for its leaderboard: the DHT holds only those under 16 KiB (rounds of about
    80 inputs), gossip those under 256 KiB; larger ones are fetched (``fetch_unheard``)."""
    while (msg := gossip.get(timeout=0)) is not None:
        run = run_of_cert_topic(msg.topic)
        if run is not None:
            watch.add_certificates(run, [bytes(msg.data)])


Wanted = list[tuple[str, int, list[str]]]  # (run id, version, peers that announce it)


def unheard(watch: NetworkWatch, state: dict[str, Any]) -> Wanted:
    """The versions the board has not counted (``watch.unheard``), each with the peers whose
    heartbeats announce it, newest holder first, three at most."""
    wanted: Wanted = []
    for run in state["runs"]:
        if run.get("incompatible"):
            continue
        run_id = run["run_id"]
        peers = sorted(
            (p for p in state["peers"] if p["run_id"] == run_id),
            key=lambda p: (-p["version"], p["peer_id"]),
        )
        for version in watch.unheard(run_id):
            holders = [p["peer_id"] for p in peers if p["version"] >= version][:3]
            if holders:
                wanted.append((run_id, version, holders))
    return wanted


async def fetch_unheard(transport: Transport, wanted: Wanted) -> list[tuple[str, bytes]]:
    """Each wanted certificate from the first of its peers that serves it with a quorum of
    valid signatures; a peer that fails or lies costs one try. Returns (run id, bytes)."""
    got: list[tuple[str, bytes]] = []
    for run_id, version, peers in wanted:
        for peer in peers:
            try:
                raw = await fetch_cert(transport, peer, version)
                if parse_certificate(raw, run_id=run_id).body.version != version:
                    raise InvalidRecord(f"certificate of another version than {version}")
            except (RpcError, InvalidRecord) as e:
                log.debug("certificate %d from %s: %s", version, peer, e)
                continue
            got.append((run_id, raw))
            break
    return got


class BootstrapServer:
    """Start with ``start()`` (or as a context manager); ``close()`` stops everything."""

    def __init__(self, cfg: BootstrapConfig) -> None:
        self.cfg = cfg
        # Its own file: a node and a bootstrap on one machine must never share a peer id.
        self.identity_path = cfg.identity or default_identity_path().with_name("bootstrap.key")
        self.identity = Identity.load_or_create(self.identity_path)
        self.started = time.time()
        self._stop = threading.Event()
        self._state: dict[str, Any] = NetworkState().to_dict()
        self._seq = 0
        self.dht: DHTPlane | None = None
        self.gossip: GossipProcess | None = None
        self.bridge: P2PBridge | None = None
        self.http: HTTPApi | None = None
        self._thread: threading.Thread | None = None
        self._fetching: Future[list[tuple[str, bytes]]] | None = None
        self.registry = CollectorRegistry()
        self.m_peers = Gauge("p2pdiloco_peers", "live peers over all runs", registry=self.registry)
        self.m_runs = Gauge("p2pdiloco_runs", "known runs", registry=self.registry)
        self.m_up = Gauge("p2pdiloco_up", "1 while the DHT is alive", registry=self.registry)
        self.m_rejected = Counter(
            "p2pdiloco_rejected_records", "invalid records dropped", registry=self.registry
        )
        self.m_polls = Counter("p2pdiloco_state_polls", "DHT state polls", registry=self.registry)
        self.watch = NetworkWatch()  # event lines and the leaderboard (refresh thread only)

    def start(self) -> None:
        """Bring up DHT, dial-back, gossip and HTTP. Raises NetworkError/OSError on failure."""
        cfg = self.cfg
        install_noise_filter()  # before the DHT forks: its child inherits the filter
        log.info("starting the DHT node (p2pd) on %s:%s", cfg.host, cfg.port or "any port")
        self.dht = DHTPlane(
            self.identity,
            initial_peers=cfg.initial_peers,
            host=cfg.host,
            port=cfg.port,
            announce=cfg.announce,
            relay_service=True,
            force_public=True,
            identity_path=self.identity_path,
        )
        self.bridge = P2PBridge(self.dht.dht)
        self.bridge.run(serve_dialback(self.bridge.p2p), timeout=30)
        gossip_port = cfg.port + 1 if cfg.port else 0
        log.info("DHT node up; starting the gossip host")
        self.gossip = GossipProcess(
            self.identity.seed, topics=[ANNOUNCE_TOPIC], listen_host=cfg.host, port=gossip_port
        )
        try:
            self.gossip.start()
        except GossipError as e:  # gossip only accelerates: run on without it
            log.warning("gossip host did not start (%s); serving DHT only", e)
            self.gossip = None
        self.http = HTTPApi(
            cfg.http_host,
            cfg.http_port,
            healthy=self.healthy,
            state=self.state,
            registry=self.registry,
            page=render_page,
        )
        self.http.start()
        self._refresh()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bootstrap")
        self._thread.start()

    def multiaddrs(self) -> list[str]:
        """Full, copy-pasteable DHT multiaddrs (announced ones first)."""
        assert self.dht is not None
        pid = self.identity.peer_id
        announced = [a if "/p2p/" in a else f"{a}/p2p/{pid}" for a in self.cfg.announce]
        return announced + [a for a in self.dht.visible_maddrs() if a not in announced]

    def healthy(self) -> bool:
        return self.dht is not None and self.dht.dht.is_alive()

    def state(self) -> dict[str, Any]:
        return {
            **self._state,
            "server": {
                "peer_id": self.identity.peer_id,
                "version": __version__,
                "multiaddrs": self.multiaddrs() if self.dht else [],
                "gossip": self.gossip.maddrs if self.gossip and self.gossip.alive else [],
                "gossip_restarts": self.gossip.restarts if self.gossip else 0,
                "uptime_s": round(time.time() - self.started, 1),
            },
        }

    def _heartbeat(self) -> bytes:
        self._seq += 1
        hb = Heartbeat(
            peer_id=self.identity.peer_id,
            island="bootstrap",
            roles=["bootstrap"],
            hardware=Hardware(device="cpu", name="bootstrap", memory_gb=0.0, count=0),
            throughput_tps=0.0,
            version=0,
            addrs=self.multiaddrs()[:16],
            gossip_addrs=(self.gossip.maddrs if self.gossip and self.gossip.alive else [])[:16],
            reachability="direct",
            seq=self._seq,
        )
        return seal(self.identity, "heartbeat", "", hb.model_dump(mode="json"))

    def _refresh(self) -> None:
        assert self.dht is not None
        try:
            self.dht.store(
                keys.bootstraps_key(), self.identity.peer_id, self._heartbeat(), keys.HEARTBEAT_TTL
            )
            state = collect_state(self.dht)
        except Exception:  # never let one bad poll take the server down
            log.exception("state refresh failed")
            return
        self.m_polls.inc()
        self.m_rejected.inc(len(state.rejected))
        new = state.to_dict()
        for run in state.runs:
            if not run.incompatible:
                self.watch.follow(run.run_id, run.manifest)
                self.watch.add_certificates(run.run_id, read_certificates(self.dht, run.run_id))
        self._fetch_unheard(new)
        for r in new["runs"]:  # the run's version is its verified chain's, never a heartbeat's
            r["certified_version"] = self.watch.version(r["run_id"])
        new["leaderboards"] = {
            r["run_id"]: self.watch.leaderboard(r["run_id"]) for r in new["runs"]
        }
        new["curves"] = {r["run_id"]: self.watch.curve(r["run_id"]) for r in new["runs"]}
        for line in self.watch.update(new):
            log.info("%s", line)
        self._state = new
        self.m_runs.set(len(self._state["runs"]))
        self.m_peers.set(len(self._state["peers"]))
        self.m_up.set(1 if self.healthy() else 0)
        if self.gossip and self.gossip.alive:
            for run in self._state["runs"]:
                self.gossip.subscribe(f"p2pdiloco/v1/run/{run['run_id']}")
                self.gossip.subscribe(cert_topic(run["run_id"]))

    def _fetch_unheard(self, state: dict[str, Any]) -> None:
        """Count what the last fetch brought, and start the next one: certificates neither the
        DHT nor gossip could carry, fetched on the bridge's loop while this thread goes on
        (one fetch at a time; the board is this thread's alone)."""
        done = self._fetching
        if done is not None and not done.done():
            return
        if done is not None:
            try:
                for run_id, raw in done.result():
                    self.watch.add_certificates(run_id, [raw])
            except Exception:  # the next poll asks again
                log.exception("fetching certificates failed")
        self._fetching = None
        wanted = unheard(self.watch, state)
        if self.bridge is None or not wanted:
            return
        addrs = {p["peer_id"]: p["addrs"] for p in state["peers"]}
        transport = P2PTransport(
            self.bridge.p2p, self.identity.peer_id, lambda peer: addrs.get(peer, [])
        )
        coro = fetch_unheard(transport, wanted)
        self._fetching = asyncio.run_coroutine_threadsafe(coro, self.bridge.loop)

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.refresh_interval):
            self._refresh()
            if self.gossip is not None:
                read_gossip(self.gossip, self.watch)

    def close(self) -> None:
        """Stop every part (idempotent); the identity key stays on disk."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for part in (self.http, self.gossip, self.bridge, self.dht):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.exception("error while stopping %s", type(part).__name__)
        self.http = self.gossip = self.bridge = self.dht = None

    def __enter__(self) -> BootstrapServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
