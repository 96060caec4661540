"""A node that trains: the learner loop, its syncer duty, and everything certified it keeps.

One loop, top to bottom (``_round``): train H inner steps from the certified version v → send
the compressed, signed delta to the committee of v+1 → keep training while it is in flight →
apply the next certificate (verified; the state merged here if this node was a syncer that
agreed with the quorum, else downloaded in verified chunks) → rebase. The syncer side runs on
the P2P loop (``sync.service``) and hands certified versions back through ``_inbox``.

On disk, under ``state_dir``: ``certified/`` (the last certified states, atomic checkpoints
with their certificate), ``certs/<version>.json`` (every certificate applied: this node's
receipts) and ``status.json`` (a snapshot for monitors and the demo). A restart resumes from
the newest certified checkpoint whose hash matches its certificate, then catches up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.ledger import build_ledger
from p2pdiloco.net.cert_records import (
    cert_topic,
    cert_version,
    publish_certificate,
    read_certificates,
)
from p2pdiloco.net.gossip import GossipMessage
from p2pdiloco.net.sync_rpc import RpcError, call
from p2pdiloco.node import Node
from p2pdiloco.protocol.certificates import Certificate, parse_certificate
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.protocol.submissions import (
    FragmentRef,
    SubmissionHeader,
    payload_digest,
    seal_submission,
)
from p2pdiloco.sync.attacks import AttackConfig
from p2pdiloco.sync.certified import CertifiedState, genesis_state
from p2pdiloco.sync.fetch import SyncError, catch_up, download_state, fetch_cert
from p2pdiloco.sync.roster import committee_for
from p2pdiloco.sync.service import SyncService, SyncSettings
from p2pdiloco.train.checkpoint import CheckpointError, CheckpointStore, atomic_write_bytes
from p2pdiloco.train.data import build_corpus, eval_batches
from p2pdiloco.train.device import resolve_device
from p2pdiloco.train.inner import evaluate
from p2pdiloco.train.learner import Learner, Outgoing
from p2pdiloco.train.local_state import load_local, restore_local, save_local
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """How this node trains and syncs (the run's rules come from its manifest)."""

    state_dir: Path
    device: str = "auto"
    threads: int | None = None  # torch intra-op threads; None: torch's default
    until_version: int | None = None  # stop training once this version is applied; keep serving
    attack: str | None = None  # play an attacker (demo and tests only)
    max_data_bytes: int = 16 * 2**20
    micro_batch: int | None = None  # sequences per forward pass; None: the whole step batch
    sync: SyncSettings = field(default_factory=SyncSettings)


@dataclass
class Stats:
    sent: int = 0
    accepted: int = 0  # by the certificate (receipts)
    rejected: int = 0  # refused at submission or screened out
    tokens_accepted: int = 0
    tokens_trained: int = 0
    last_loss: float | None = None
    downloads: list[dict[str, Any]] = field(default_factory=list)
    losses: deque[float] = field(default_factory=lambda: deque(maxlen=48))
    inner_step: int = 0  # steps trained since the last send
    step_seconds: float = 0.0  # recent seconds per inner step (EMA)
    tokens_per_second: float = 0.0
    paused_reason: str | None = None
    events: deque[str] = field(default_factory=lambda: deque(maxlen=50))
    tokens_by_peer: dict[str, int] = field(default_factory=dict)  # ledger of verified receipts
    eval_losses: deque[float] = field(default_factory=lambda: deque(maxlen=48))


class Participant:
    def __init__(self, node: Node, cfg: TrainConfig) -> None:
        assert node.run is not None and node.bridge is not None
        self.node = node
        self.cfg = cfg
        self.run_id = node.run.run_id
        self.manifest = node.run.manifest
        self.me = node.identity.peer_id
        self.stats = Stats()
        self.phase = "starting"
        self.error: str | None = None
        self._inbox: queue.Queue[tuple[bytes, CertifiedState | None]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_sent: tuple[bytes, bytes] | None = None  # first submission (replay attacker)
        self._pending: str | None = None  # digest of our submission awaiting a certificate
        self._eval_model: torch.nn.Module | None = None
        self._eval_rows: list[torch.Tensor] = []
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        (cfg.state_dir / "certs").mkdir(exist_ok=True)
        self.store = CheckpointStore(cfg.state_dir / "certified", keep=2)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.device = resolve_device(self.cfg.device)
        spec = get_spec(self.manifest.model)
        self.corpus = build_corpus(
            self.manifest.data,
            load_tokenizer(spec.tokenizer),
            seq_len=self.manifest.inner.seq_len,
            max_bytes=self.cfg.max_data_bytes,
        )
        if self.node.run is not None and self.node.run.raw:  # for offline leaderboards
            atomic_write_bytes(self.cfg.state_dir / "manifest.json", self.node.run.raw)
        self.state = self._restore() or genesis_state(self.manifest)
        self._init_ledger()
        self.service = SyncService(
            self.node.identity,
            self.run_id,
            self.manifest,
            {n: tuple(t.shape) for n, t in self.state.params.items()},
            replace(self.cfg.sync, rule=self.manifest.aggregation),
            addrs_of=self.node.peer_addrs,
            active_learners=lambda: len(self.node.peers_holding(0)) + 1,
            on_certified=lambda raw, st: self._inbox.put((raw, st)),
        )
        bridge = self.node.bridge
        assert bridge is not None
        bridge.run(self.service.start(bridge.p2p), 30)
        for path in sorted((self.cfg.state_dir / "certs").glob("*.json")):
            self.service.add_cert(int(path.stem), path.read_bytes())
        bridge.run(self.service.install(self.state), 120)
        self.node.version = self.state.version
        self.node.on_gossip = self._on_gossip
        attack = AttackConfig(self.cfg.attack) if self.cfg.attack else None
        self.learner = Learner(
            self.manifest,
            self.corpus,
            self.me,
            self.state.params,
            device=self.device,
            attack=attack,
            base_version=self.state.version,
            micro_batch=self.cfg.micro_batch,
        )
        local = load_local(self.cfg.state_dir, self.run_id)
        same_base = local is not None and int(local.get("base_version", -1)) == self.state.version
        if local is not None and same_base and restore_local(self.learner, local):
            self.event(
                f"resumed local progress: {self.learner.steps_since_send} steps "
                f"on version {self.state.version}"
            )
        self._thread = threading.Thread(target=self._main, daemon=True, name="participant")
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> str:
        """Stop after the current stretch of steps (an in-flight delta is abandoned), save the
        local progress next to the certified state, and say what was kept."""
        self._set_phase("stopping")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.node.bridge is not None:
            with contextlib.suppress(Exception):
                self.node.bridge.run(self.service.close(), 5)
        kept = f"certified version {self.state.version} under {self.cfg.state_dir}"
        if hasattr(self, "learner") and not self.alive:
            save_local(self.cfg.state_dir, self.learner, self.run_id, self.state.version)
            kept += f", plus {self.learner.steps_since_send} local steps not yet merged"
        self._write_status()
        return kept

    def event(self, text: str) -> None:
        log.info(text)
        self.stats.events.append(f"{time.strftime('%H:%M:%S')} {text}")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the loop ----------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._set_phase("syncing state")
            self._catch_up_from_network()
            while not self._stop.is_set():
                target = self.cfg.until_version
                if target is not None and self.state.version >= target:
                    self._set_phase(f"idle: version {target} reached")
                    self._drain(wait=1.0)
                    continue
                self._round()
        except Exception as e:  # reported in the status and the log; the node keeps serving
            log.exception("training loop stopped")
            self.error = f"{type(e).__name__}: {e}"
            self._set_phase("failed")

    def _round(self) -> None:
        """Train from version v, send the delta, keep training until v+1 (or newer) applies."""
        H = self.manifest.inner_steps
        chunk = self._chunk_steps()
        base = self.state
        self._set_phase("training")
        tokens, loss = 0, 0.0
        trained = 0
        while trained < H and not self._stop.is_set():
            st = self._train(chunk)
            trained += st.steps
            tokens += st.tokens
            loss = st.loss_last
            self._drain(wait=0)  # a newer version mid-stretch: rebase and keep going
            base = self.state
        if self._stop.is_set():
            return
        out = self.learner.outgoing(base.version, base.params, tokens, loss)
        self._set_phase("submitting")
        self._submit(out)
        self._set_phase("waiting for certificate")
        deadline_poll = 0.0
        while self.state.version <= out.base_version and not self._stop.is_set():
            if self.learner.steps_since_send < H:
                self._train(chunk)  # keep training while the delta is in flight
            if time.monotonic() >= deadline_poll:
                self._poll_certificates(out.base_version + 1)
                deadline_poll = time.monotonic() + 2.0
            self._drain(wait=0.2, sent=out)

    def _train(self, steps: int) -> Any:
        st = self.learner.train(steps)
        s = self.stats
        s.tokens_trained += st.tokens
        s.last_loss = st.loss_last
        s.losses.append(st.loss_last)
        s.inner_step = self.learner.steps_since_send
        per_step = st.seconds / max(1, st.steps)
        s.step_seconds = per_step if s.step_seconds == 0 else 0.7 * s.step_seconds + 0.3 * per_step
        s.tokens_per_second = st.tokens / st.seconds if st.seconds > 0 else 0.0
        return st

    def _chunk_steps(self) -> int:
        H = self.manifest.inner_steps
        return max(1, H // 4) if H % 4 == 0 else H

    # -- submitting --------------------------------------------------------------------------

    def _submit(self, out: Outgoing) -> None:
        header = SubmissionHeader(
            peer_id=self.me,
            base_version=out.base_version,
            steps=max(1, out.steps),
            tokens=max(1, out.tokens),
            loss=min(max(out.loss, 0.0), 1e4),
            codec=self.manifest.compression,
            fragments=[
                FragmentRef(index=0, digest=payload_digest(out.payload), nbytes=len(out.payload))
            ],
        )
        raw = seal_submission(self.node.identity, self.run_id, header)
        frames = (raw, out.payload)
        if self.cfg.attack == "replay" and self._last_sent is not None:
            frames = self._last_sent  # re-send its first signed submission, byte for byte
        elif self._last_sent is None:
            self._last_sent = frames
        self._pending = hashlib.sha256(frames[0]).hexdigest()
        committee = committee_for(self.run_id, self.manifest, self.state.cert)
        pending = list(committee.members)
        self.stats.sent += 1
        statuses: dict[str, str] = {}
        backoff = 1.0
        for _ in range(20):
            replies = self._call_all(pending, "submit", frames)
            pending = []
            for peer, reply in replies.items():
                status = reply.get("status", "error") if isinstance(reply, dict) else "error"
                statuses[peer] = status
                if status == "retry":
                    pending.append(peer)
                elif status == "rejected":
                    self.event(f"delta refused by {peer[-8:]}: {reply.get('reason')}")
            if replies and all(st == "error" for st in statuses.values()):
                # Nobody on the committee answered: the network (ours or theirs) is down.
                pending = list(replies)
                self.stats.paused_reason = f"no syncer reachable, retrying in {backoff:.0f} s"
                self._set_phase("paused")
                self.event(f"network: no syncer reachable; retrying in {backoff:.0f} s")
            if not pending or self._stop.is_set() or self.state.version > out.base_version:
                break
            self._drain(wait=backoff, sent=out)
            backoff = min(backoff * 2, 30.0) if self.phase == "paused" else 1.0
        self.stats.paused_reason = None
        accepted = sum(1 for s in statuses.values() if s == "accepted")
        log.info(
            "submitted delta on version %d to %d syncers: %d accepted for merging",
            out.base_version,
            len(committee.members),
            accepted,
        )

    def _call_all(
        self, peers: Sequence[str], op: str, frames: tuple[bytes, bytes]
    ) -> dict[str, Any]:
        bridge = self.node.bridge
        assert bridge is not None

        async def one(peer: str) -> Any:
            if peer == self.me:
                reply, _ = await self.service.handle(op, self.me, {}, list(frames))
                return reply
            try:
                reply, _ = await call(
                    bridge.p2p, peer, op, frames=frames, addrs=self.node.peer_addrs(peer)
                )
                return reply
            except RpcError as e:
                return {"status": "error", "reason": str(e)}

        async def all_() -> list[Any]:
            return await asyncio.gather(*(one(p) for p in peers))

        try:
            results = bridge.run(all_(), 120)
        except Exception as e:
            log.warning("submitting failed: %s", e)
            return {}
        return dict(zip(peers, results, strict=True))

    # -- certificates ------------------------------------------------------------------------

    def _on_gossip(self, msg: GossipMessage) -> None:
        if msg.topic == cert_topic(self.run_id) and len(msg.data) < (1 << 20):
            self._inbox.put((bytes(msg.data), None))

    def _poll_certificates(self, version: int) -> None:
        """Ask the committee (and anyone announcing it) for the certificate of ``version``."""
        bridge = self.node.bridge
        assert bridge is not None
        committee = committee_for(self.run_id, self.manifest, self.state.cert)
        peers = [m for m in committee.members if m != self.me]
        peers += [p for p, _ in self.node.peers_holding(version) if p not in peers]
        for peer in peers[:6]:
            try:
                raw = bridge.run(
                    fetch_cert(bridge.p2p, peer, version, self.node.peer_addrs(peer)), 20
                )
            except Exception:
                continue
            self._inbox.put((raw, None))
            return

    def _drain(self, wait: float, sent: Outgoing | None = None) -> None:
        """Apply every certificate that arrived (newest wins); wait up to ``wait`` for one."""
        try:
            items = [self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()]
        except queue.Empty:
            return
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for raw, computed in sorted(items, key=lambda it: cert_version(it[0])):
            try:
                self._advance(raw, computed, sent)
            except (InvalidRecord, SyncError, RpcError, TimeoutError) as e:
                log.warning("could not apply a certificate: %s", e)

    def _advance(self, raw: bytes, computed: CertifiedState | None, sent: Outgoing | None) -> None:
        cert = parse_certificate(raw, run_id=self.run_id)
        if cert.body.version <= self.state.version:
            return
        self._set_phase("applying")
        bridge = self.node.bridge
        assert bridge is not None
        peers = self._holders(cert)
        chain = bridge.run(
            catch_up(bridge.p2p, self.run_id, self.manifest, self.state.cert, cert, peers), 120
        )
        cert = chain[-1]
        if computed is not None and computed.state_hash == cert.body.state_hash:
            new = computed
            new.cert = cert
        else:
            dl = bridge.run(download_state(bridge.p2p, cert, peers), 600)
            new = dl.state
            self.stats.downloads.append(
                {"version": cert.body.version, "chunks_by_peer": dict(dl.chunks_by_peer)}
            )
            log.info(
                "downloaded state of version %d from %d peers (%s)",
                cert.body.version,
                len(dl.chunks_by_peer),
                ", ".join(f"{p[-8:]}: {n}" for p, n in dl.chunks_by_peer.items()),
            )
        self._persist(chain, new)
        bridge.run(self.service.install(new), 120)
        committee = self.service.committee
        self.node.roles = (
            ["learner", "syncer"] if committee and self.me in committee.members else ["learner"]
        )
        old = self.state
        mine = [a for a in cert.body.accepted if a.peer_id == self.me]
        merged = set()
        for c in chain:
            for a in c.body.accepted:
                self.stats.tokens_by_peer[a.peer_id] = (
                    self.stats.tokens_by_peer.get(a.peer_id, 0) + a.tokens
                )
            for a in c.receipts(self.me):
                self.stats.accepted += 1
                self.stats.tokens_accepted += a.tokens
                merged.add(a.digest)
        if self._pending is not None:  # our delta in flight missed this version: it is lost
            if self._pending not in merged:
                self.stats.rejected += 1
            self._pending = None
        self.learner.rebase(new.params, old.params, sent)
        self._evaluate(new)
        self.stats.inner_step = self.learner.steps_since_send
        if len(chain) > 1:  # skipped versions: follow the run's lr schedule, not ours
            self.learner.seek(new.version * self.manifest.inner_steps)
        self.state = new
        self.node.version = new.version
        self._publish(cert)
        self.event(
            f"applied version {new.version} (committee "
            f"{', '.join(m[-8:] for m in cert.body.committee)}; {len(cert.body.accepted)} deltas "
            f"merged{', ours among them' if mine else ''})"
        )
        self._write_status()

    def _evaluate(self, state: CertifiedState) -> None:
        """Eval loss of a certified version for the dashboard, when the model is small enough
        for it to be cheap (a few eval batches on a separate copy)."""
        if sum(t.numel() for t in state.params.values()) > 50_000_000:
            return
        if self._eval_model is None:
            self._eval_model = build_model(self.manifest.model, seed=self.manifest.seed)
            self._eval_rows = eval_batches(
                self.corpus, batch_size=self.manifest.inner.batch_size, max_batches=2
            )
        if not self._eval_rows:
            return
        with torch.no_grad():
            for n, p in param_state(self._eval_model).items():
                p.copy_(state.params[n])
        self.stats.eval_losses.append(evaluate(self._eval_model, self._eval_rows))

    def _holders(self, cert: Certificate) -> list[tuple[str, list[str]]]:
        """Peers likely to hold the state of ``cert``: its signers, then anyone announcing it."""
        out = [(s, self.node.peer_addrs(s)) for s in cert.signers if s != self.me]
        known = {p for p, _ in out}
        out += [(p, a) for p, a in self.node.peers_holding(cert.body.version) if p not in known]
        return out

    def _catch_up_from_network(self) -> None:
        """At start: the newest certificate in the DHT or held by live peers, if newer."""
        newest: bytes | None = None
        for raw in self._dht_certificates():
            if newest is None or cert_version(raw) > cert_version(newest):
                newest = raw
        bridge = self.node.bridge
        assert bridge is not None
        for peer, addrs in self.node.peers_holding(self.state.version + 1)[:3]:
            try:
                raw = bridge.run(fetch_cert(bridge.p2p, peer, -1, addrs), 20)
            except Exception:
                continue
            if newest is None or cert_version(raw) > cert_version(newest):
                newest = raw
        if newest is not None and cert_version(newest) > self.state.version:
            log.info("catching up from version %d to %d", self.state.version, cert_version(newest))
            self._inbox.put((newest, None))
            self._drain(wait=0)

    def _dht_certificates(self) -> list[bytes]:
        return read_certificates(self.node.dht, self.run_id) if self.node.dht else []

    def _publish(self, cert: Certificate) -> None:
        publish_certificate(self.node.identity, self.run_id, cert, self.node.dht, self.node.gossip)

    # -- persistence -------------------------------------------------------------------------

    def _persist(self, chain: list[Certificate], state: CertifiedState) -> None:
        for c in chain:
            path = self.cfg.state_dir / "certs" / f"{c.body.version:08d}.json"
            atomic_write_bytes(path, c.raw)
            self.service.add_cert(c.body.version, c.raw)
        assert state.cert is not None
        self.store.save(
            state.tensors(),
            {"version": state.version, "run_id": self.run_id, "cert": state.cert.raw.decode()},
        )

    def _init_ledger(self) -> None:
        """Contribution tallies from the certificates kept on disk, verified from genesis."""
        raws = [p.read_bytes() for p in sorted((self.cfg.state_dir / "certs").glob("*.json"))]
        ledger = build_ledger(self.run_id, self.manifest, raws)
        for line in ledger.ignored:
            log.warning("ledger: %s", line)
        for e in ledger.entries:
            self.stats.tokens_by_peer[e.peer_id] = e.tokens
            if e.peer_id == self.me:
                self.stats.accepted, self.stats.tokens_accepted = e.accepted, e.tokens

    def _restore(self) -> CertifiedState | None:
        """The newest saved certified state whose hash matches its certificate, or None."""
        try:
            ckpt = self.store.load_latest(verify=True)
        except CheckpointError as e:
            log.warning("ignoring the saved state: %s", e)
            return None
        if ckpt is None or ckpt.meta.get("run_id") != self.run_id:
            return None
        try:
            cert = parse_certificate(str(ckpt.meta["cert"]).encode(), run_id=self.run_id)
            state = CertifiedState.from_tensors(cert.body.version, cert, ckpt.tensors)
        except (InvalidRecord, KeyError, ValueError) as e:
            log.warning("ignoring the saved state: %s", e)
            return None
        if state.state_hash != cert.body.state_hash:
            log.warning("ignoring the saved state: it does not match its certificate")
            return None
        self.event(f"resuming from certified version {state.version} (saved on disk)")
        return state

    # -- status ------------------------------------------------------------------------------

    def _set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
            log.info(
                "state: %s (version %d)", phase, self.state.version if hasattr(self, "state") else 0
            )
        self._write_status()

    def snapshot(self) -> dict[str, Any]:
        svc = getattr(self, "service", None)
        committee = svc.committee.members if svc is not None and svc.committee else ()
        return {
            "peer_id": self.me,
            "run_id": self.run_id,
            "phase": self.phase,
            "error": self.error,
            "version": self.state.version if hasattr(self, "state") else 0,
            "committee": list(committee),
            "on_committee": self.me in committee,
            "sent": self.stats.sent,
            "accepted": self.stats.accepted,
            "rejected": self.stats.rejected,
            "tokens_accepted": self.stats.tokens_accepted,
            "tokens_trained": self.stats.tokens_trained,
            "last_loss": self.stats.last_loss,
            "downloads": self.stats.downloads[-20:],
            "rejections": list(svc.rejections[-200:]) if svc is not None else [],
        }

    def _write_status(self) -> None:
        data = json.dumps(self.snapshot()).encode()
        try:
            atomic_write_bytes(self.cfg.state_dir / "status.json", data, durable=False)
        except OSError as e:
            log.debug("status write failed: %s", e)
