"""Free riders against a local network, for the tests and the benchmark of issue 44.

Fresh identities that never train send, for every certified version, the run's own public
certified update of that version as their delta: fetched over the real ``cert`` and ``update``
ops from a node that holds it (its very bytes where the run's update and submission codecs are
one, as with ``run create``'s int8; the same bytes from every rider), claiming an honest
delta's credit (steps = H, tokens = H × batch × seq_len). They announce heartbeats as
learners, so a round waits for them as for any live learner. They speak the sync protocol
from one DHT client of this process, as any peer could; the nodes are real processes
(``p2pdiloco.harness.demo.LocalNetwork``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from p2pdiloco.compress import get_codec
from p2pdiloco.compress.wire import pack_deltas
from p2pdiloco.errors import UserError
from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import NodeProc
from p2pdiloco.harness.sybil import gather_replies, submit
from p2pdiloco.net import keys
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.net.discovery import read_peers
from p2pdiloco.net.p2p_bridge import P2PBridge
from p2pdiloco.net.sync_rpc import RpcError
from p2pdiloco.net.transport import P2PTransport
from p2pdiloco.protocol.certificates import Certificate, parse_certificate
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import Hardware, Heartbeat, RunManifest
from p2pdiloco.protocol.signing import InvalidRecord, seal
from p2pdiloco.protocol.submissions import (
    FragmentRef,
    SubmissionHeader,
    payload_digest,
    seal_submission,
)
from p2pdiloco.sync.fetch import SyncError, download_update
from p2pdiloco.sync.update import decode_update, max_update_bytes, rules_codec
from p2pdiloco.train.models import build_model, param_state

Targets = dict[str, list[str]]  # peer id → the multiaddrs of its heartbeat
HEARTBEAT_EVERY = 2.0  # seconds between the riders' heartbeats (a node's, in the tests)


@dataclass
class RideReport:
    riders: list[str]  # their peer ids
    replies: list[dict[str, Any]] = field(default_factory=list)
    sent_for: dict[int, str] = field(default_factory=dict)  # base version → payload digest sent
    first_base: int = 0  # the first base version the riders sent for
    until: int = 0  # the version every node held when they stopped (at least)
    seconds: float = 0.0  # from the first send to the end
    # base version → seconds from the riders' first sight of its certificate to the update
    # in hand, and from there to every reply (how late they are against the round's close)
    lags: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def accepted(self) -> int:
        """Submissions the nodes took into a round's pool (merging is the committee's call)."""
        return sum(r.get("status") == "accepted" for r in self.replies)


def _versions(nodes: list[NodeProc]) -> list[int]:
    return [int(n.status().get("version", 0)) for n in nodes]


def heartbeat(rider: Identity, run_id: str, version: int, seq: int) -> bytes:
    """A learner's heartbeat for ``rider``: live riders are learners a round waits for (it
    closes at once only when every live learner is in), so their sends are not too late."""
    hb = Heartbeat(
        peer_id=rider.peer_id,
        island=rider.peer_id[-16:],
        roles=["learner"],
        hardware=Hardware(device="cpu", name="free rider", memory_gb=1.0, count=1),
        throughput_tps=1000.0,
        version=version,
        addrs=[],
        gossip_addrs=[],
        reachability="direct",
        seq=seq,
    )
    return seal(rider, "heartbeat", run_id, hb.model_dump(mode="json"))


class _Replayer:
    """Fetches the newest certified update over the sync protocol, as any peer may."""

    def __init__(self, bridge: P2PBridge, run_id: str, m: RunManifest, targets: Targets) -> None:
        self.run_id, self.m, self.targets = run_id, m, targets
        self.transport = P2PTransport(bridge.p2p, "", lambda p: targets.get(p, []))
        model = build_model(m.model, seed=0)
        self.shapes = {n: tuple(t.shape) for n, t in param_state(model).items()}
        self.codec = rules_codec(m.rules)

    async def newest(self) -> tuple[Certificate, str] | None:
        """The newest certificate any target serves (``cert`` of version -1), and who."""

        async def ask(peer: str) -> tuple[Certificate, str] | None:
            try:
                _, frames = await self.transport.call(peer, "cert", args={"version": -1})
                return parse_certificate(frames[0], run_id=self.run_id), peer
            except (RpcError, InvalidRecord, IndexError):
                return None

        got = [g for g in await asyncio.gather(*(ask(p) for p in self.targets)) if g]
        return max(got, key=lambda g: g[0].body.version, default=None)

    async def payload(self, cert: Certificate, peer: str) -> bytes | None:
        """The update ``cert`` names, from ``peer`` (``update``, checked against the update
        hash), as a submission payload: its very bytes when the run's update and submission
        codecs are one (a gradient update is a delta pack), else decoded and re-encoded with
        the submission codec; None when ``peer`` does not hold it yet."""
        try:
            raw, _ = await download_update(
                self.transport, cert, [peer], max_update_bytes(self.codec, self.shapes)
            )
        except SyncError:
            return None
        if self.codec.name == self.m.compression and self.m.rules.update_form == "gradient":
            return bytes(raw)
        update = decode_update(raw, self.codec, self.shapes)
        send = get_codec(self.m.compression)
        return pack_deltas({n: send.encode(update[n]) for n in sorted(update)})


def ride(
    net: LocalNetwork,
    run_id: str,
    nodes: list[NodeProc] | Callable[[], list[NodeProc]],
    *,
    count: int = 4,
    start: int | Callable[[], int] = 1,
    until: int = 8,
    rounds: int | None = None,
    window: float | None = None,
    timeout: float = 600.0,
) -> RideReport:
    """Ride from certified version ``start`` (at least 1: version 0 has no update) until every
    node holds ``until`` (or, with ``rounds``, that many versions past the first one ridden;
    with ``window``, for that many seconds from the first send: a pace measurement).
    The riders announce themselves as learners; for every newest certified version a node
    serves, each rider sends every node the replayed update once.

    A callable ``start`` is called once the riders are ready (their DHT node, the nodes'
    addresses, the shapes of the update) and before they announce themselves; the version it
    returns is ``start``, and ``timeout`` counts from its return. Riders arriving in a running
    network (the mature-run attack) then arrive without their own start-up in the way: it
    took 16 s, three versions, with torch and transformers still to import. A callable
    ``nodes`` starts the honest nodes once the riders' DHT node is up and the update's shapes
    are known (a model built: 8-10 s on a loaded machine), so the riders' own start-up does not
    eat a young run's first versions; they still wait for the nodes' heartbeats and the first
    update (before the model was built first, two busy loops let the run mature first: v4)."""
    m = net.manifest
    assert m is not None and net.boot_addr, "start the bootstrap and publish the run first"
    riders = [Identity.generate() for _ in range(count)]
    report = RideReport([r.peer_id for r in riders])
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    threads: list[threading.Thread] = []
    with DHTPlane(Identity.generate(), initial_peers=[net.boot_addr], host="127.0.0.1") as dht:
        bridge = P2PBridge(dht.dht)
        try:
            targets: Targets = {}  # filled from the nodes' heartbeats below
            replayer = _Replayer(bridge, run_id, m, targets)  # builds a model: before the nodes
            if callable(nodes):
                nodes = nodes()
            want = {n.identity.peer_id for n in nodes}
            while not want <= set((view := read_peers(dht, run_id)).peers):
                if time.monotonic() > deadline:
                    raise UserError("the riders never saw every node's heartbeat")
                pause.wait(0.5)
            targets.update({p: list(view.peers[p].heartbeat.addrs) for p in sorted(want)})
            first = start() if callable(start) else start
            if callable(start):
                deadline = time.monotonic() + timeout
            newest = [0]  # the version the riders announce
            announcer = threading.Thread(
                target=_announce, args=(dht, run_id, riders, newest, pause), daemon=True
            )
            announcer.start()
            threads.append(announcer)
            t0 = 0.0
            if window is not None:  # a measure of time, not of versions
                until = 2**62
            while min(_versions(nodes)) < until or not report.sent_for:
                if window is not None and report.sent_for and time.monotonic() - t0 >= window:
                    break
                if time.monotonic() > deadline:
                    raise UserError(f"the nodes did not reach version {until} with riders")
                got = bridge.run(replayer.newest(), 60)
                base = newest[0] = got[0].body.version if got else 0
                if got and base >= max(1, first) and base not in report.sent_for:
                    seen = time.monotonic()
                    payload = bridge.run(replayer.payload(*got), 120)
                    if payload is not None:
                        if not report.sent_for:
                            report.first_base, t0 = base, time.monotonic()
                            if rounds is not None:
                                until = base + rounds
                            report.until = until
                        report.sent_for[base] = payload_digest(payload)
                        packed = time.monotonic()
                        sends = _sends(bridge, riders, run_id, m, base, payload, targets)
                        report.replies += bridge.run(gather_replies(sends), 120)
                        report.lags[base] = (packed - seen, time.monotonic() - packed)
                for n in nodes:
                    if n.proc.poll() is not None:
                        raise UserError(f"{n.name} exited during the ride:\n{n.log_tail()}")
                pause.wait(0.2)  # polls the nodes for their newest certificate
            report.seconds = time.monotonic() - t0
            if window is not None:
                report.until = min(_versions(nodes))
        finally:
            pause.set()  # ends the heartbeats: none may be storing when the DHT shuts down
            for t in threads:
                t.join(60)
            bridge.close()
    return report


def _announce(
    dht: DHTPlane, run_id: str, riders: list[Identity], newest: list[int], stop: threading.Event
) -> None:
    """Every rider's heartbeat every ``HEARTBEAT_EVERY`` s until ``stop`` (its own thread: a
    DHT store takes a while, and the sends must not wait for it)."""
    seq = 0
    while not stop.is_set():
        seq += 1
        for r in riders:
            raw = heartbeat(r, run_id, newest[0], seq)
            dht.store(keys.run_peers_key(run_id), r.peer_id, raw, keys.HEARTBEAT_TTL)
        stop.wait(HEARTBEAT_EVERY)


def _sends(
    bridge: P2PBridge,
    riders: list[Identity],
    run_id: str,
    m: RunManifest,
    base: int,
    payload: bytes,
    targets: Targets,
) -> list[Coroutine[Any, Any, dict[str, Any]]]:
    """Every rider's submission of ``payload`` on ``base`` to every target: an honest delta's
    claim, steps = H and tokens = H × batch × seq_len."""
    steps = m.inner_steps
    tokens = steps * m.inner.batch_size * m.inner.seq_len
    ref = FragmentRef(index=0, digest=payload_digest(payload), nbytes=len(payload))
    sends = []
    for ident in riders:
        header = SubmissionHeader(
            peer_id=ident.peer_id,
            base_version=base,
            steps=steps,
            tokens=tokens,
            loss=1.0,
            codec=m.compression,
            fragments=[ref],
        )
        raw = seal_submission(ident, run_id, header)
        sends += [
            submit(bridge, target, addrs, [raw, payload]) for target, addrs in targets.items()
        ]
    return sends
