"""The node runtime: one asyncio loop owns everything network-facing of a node.

    main thread ──start/stop──▶ NodeRuntime (one asyncio loop, thread "p2p")
                                  ├─ ChainStore    certificates, current/previous state, disk
                                  ├─ SyncService   syncer duty: the SyncerRound of v+1
                                  ├─ Plane         membership, heartbeats, DHT and gossip
                                  ├─ Transport     requests to peers, the handler for theirs
                                  └─ tasks: ticker, certificate applier, submission sender, poller
    trainer thread ──submit()──▶ outbox          certified states, replies ──deliver()──▶ trainer

The current certified version lives in one place (``chain``). The trainer learns of it by
message (``Certified``); the dashboard reads immutable views (``view``). Blocking work (hashing,
merging, checkpoint writes, eval, DHT I/O) runs in the loop's executor, never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pdiloco.aio import cancel_and_wait
from p2pdiloco.core.delivery import (
    Answer,
    Committee,
    Delivery,
    DeliveryEffect,
    DeliveryEvent,
    Pause,
    PollReceipt,
    Receipt,
    ReceiptDue,
    Send,
    Settled,
    Tell,
    Timer,
    Verdict,
    Wait,
)
from p2pdiloco.core.ledger import build_ledger
from p2pdiloco.core.roster import committee_for
from p2pdiloco.net.cert_records import cert_version, fetch_cert, signed_claims
from p2pdiloco.net.plane import Plane, Presence
from p2pdiloco.net.sync_rpc import TRAFFIC, RpcError, RpcRefused
from p2pdiloco.net.transport import Transport
from p2pdiloco.protocol.certificates import Certificate, parse_certificate
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import RETRYABLE, Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.runtime.chain import ChainStore
from p2pdiloco.runtime.delivery import submit_to
from p2pdiloco.runtime.evaluator import Evaluator
from p2pdiloco.runtime.obtain import committee_state, obtain_state
from p2pdiloco.runtime.status import RuntimeView, Tally, write_quietly
from p2pdiloco.runtime.trainer import Certified, Dropped, Reply, Submission, TrainerEvent
from p2pdiloco.sync.certified import CertifiedState, genesis_state
from p2pdiloco.sync.committee_msgs import request_limits
from p2pdiloco.sync.fetch import SyncError, catch_up
from p2pdiloco.sync.held_out import HeldOutEval
from p2pdiloco.sync.scoring import work_scorer
from p2pdiloco.sync.service import SyncService
from p2pdiloco.train.data import PackedCorpus

log = logging.getLogger(__name__)

MAX_RETRIES = 5  # attempts to apply a certificate whose state no peer could serve yet


@dataclass
class RuntimeConfig:
    """Local pace of the runtime (none of it changes a certified byte)."""

    state_dir: Path
    tick: float = 0.5  # seconds between syncer-round ticks
    heartbeat: float = 5.0  # seconds between plane ticks (heartbeats, membership)
    poll: float = 2.0  # seconds between certificate polls while a delta is in flight
    evaluate: bool = True  # eval loss of each certified version (small models only)
    max_eval_params: int = 50_000_000


@dataclass
class _Pending:
    sub: Submission
    machine: Delivery  # whom it goes to, when, and what the trainer is told
    delivering: bool = False  # a delivery is under way (the poller starts none beside it)


class NodeRuntime:
    def __init__(
        self,
        identity: Identity,
        run_id: str,
        manifest: RunManifest,
        plane: Plane,
        transport: Transport,
        cfg: RuntimeConfig,
        *,
        corpus: PackedCorpus | None = None,
    ) -> None:
        self.identity = identity
        self.me = identity.peer_id
        self.run_id = run_id
        self.manifest = manifest
        self.plane = plane
        self.transport = transport
        self.cfg = cfg
        self.corpus = corpus
        self.chain = ChainStore(cfg.state_dir, run_id)
        self.service: SyncService | None = None
        self.tally = Tally(stall_after=manifest.rules.grace + manifest.rules.agree_timeout)
        self.view = RuntimeView()
        self.deliver: Callable[[TrainerEvent], None] | None = None  # set by attach()
        self.trainer_view: Callable[[], Any] = lambda: None
        self._certs_in: asyncio.Queue[tuple[bytes, CertifiedState | None]] = asyncio.Queue()
        self._outbox: asyncio.Queue[Submission] = asyncio.Queue()
        self._pending: _Pending | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False  # close() began: peers' requests are refused from then on
        self.evaluator = Evaluator(
            manifest,
            # A run with a held-out split has certified values instead (``Tally.record_chain``).
            corpus if cfg.evaluate and manifest.held_out is None else None,
            cfg.max_eval_params,
            self.tally.eval_losses.append,
        )
        self._apply_lock = asyncio.Lock()
        self._retries: dict[tuple[int, int], int] = {}  # cleared whenever a version applies

    # -- lifecycle (on the loop) -------------------------------------------------------------

    def _held_out(self) -> HeldOutEval | None:
        """The eval step this node's merges run, in a run that certifies an eval loss (ADR
        0059); None without a held-out split or a corpus (a node without one cannot sign)."""
        if self.manifest.held_out is None or self.corpus is None:
            return None
        return HeldOutEval(self.manifest, self.corpus)

    async def start(self) -> CertifiedState:
        """Restore or build the certified state, serve peers, start tasks; the trainer's start."""
        self._loop = loop = asyncio.get_running_loop()
        restored = await loop.run_in_executor(None, self.chain.restore)
        if restored is not None:
            self.tally.event(f"resuming from certified version {restored.version} (saved on disk)")
        state = restored
        if state is None:
            state = await loop.run_in_executor(None, genesis_state, self.manifest)
        await loop.run_in_executor(None, state.blob)  # hash off the loop
        raws = list(self.chain.certs.values())
        ledger = await loop.run_in_executor(None, build_ledger, self.run_id, self.manifest, raws)
        self.tally.load_ledger(ledger, self.me)
        self.service = SyncService(
            self.identity,
            self.run_id,
            self.manifest,
            {n: tuple(t.shape) for n, t in state.params.items()},
            self.transport,
            live_learners=self.plane.live_learners,
            on_certified=lambda raw, st: self._certs_in.put_nowait((raw, st)),
            held_out=self._held_out(),
            committee_state=self._committee_state,
            scorer=work_scorer(self.manifest, self.corpus),
        )
        limits = request_limits(self.service.max_payload)
        await self.transport.serve(self._handle, limits, self.service.screen)
        self.chain.install(state)
        await self.service.install(state)
        tasks = (self._ticker(), self._heartbeat(), self._applier(), self._sender(), self._poller())
        self._tasks += [asyncio.create_task(coro) for coro in tasks]
        self.tally.phase = "syncing state"
        if restored is not None and restored.cert is not None:
            # The DHT may have forgotten it (a bootstrap restarted while this run was offline).
            await self.plane.publish_certificate(restored.cert)
        for claim in await self._claims_from_network():  # newest first; junk falls through
            try:
                await self._apply(claim, None)
                break
            except (InvalidRecord, SyncError, RpcError, TimeoutError) as e:
                log.warning("could not catch up at start: %s", e)
        self.tally.phase = "serving"
        self._publish_view()
        assert self.chain.current is not None
        return self.chain.current

    async def attach(
        self, deliver: Callable[[TrainerEvent], None], view: Callable[[], Any], version: int
    ) -> None:
        """Where certified states and replies go (the trainer's inbox) and the trainer's view;
        ``version``: the one it trains from (a newer one is delivered at once)."""
        self.deliver, self.trainer_view = deliver, view
        self.tally.phase = "training"
        current = self.chain.current
        if current is not None and current.version > version:
            deliver(Certified(current, frozenset()))

    async def close(self) -> None:
        self._stopping = True
        await cancel_and_wait(self._tasks, "node runtime")
        if self.service is not None:
            await self.service.close()

    # -- thread-safe entries (from the trainer thread) ---------------------------------------

    def submit(self, sub: Submission) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._outbox.put_nowait, sub)

    def request_version(self, version: int) -> None:
        """A fast-forward hint: look for the certificate of ``version`` now."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._poll_certificate(version), self._loop)

    # -- requests from peers -----------------------------------------------------------------

    async def _handle(
        self, op: str, peer: str, control: dict[str, Any], frames: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        if op in ("cert", "index", "chunk", "update"):
            return self.chain.serve(op, control)
        if self.service is None:
            raise RpcRefused(Reason.NO_STATE, "starting")
        if self._stopping:  # its workers are shutting down (a request raced Ctrl-C)
            raise RpcRefused(Reason.BUSY, "this node is stopping")
        return await self.service.handle(op, peer, control, frames)

    # -- tasks ---------------------------------------------------------------------------------

    async def _ticker(self) -> None:
        """Syncer-round clock ticks; never waits on the plane."""
        while True:
            assert self.service is not None
            try:
                self.service.tick()
                self._publish_view()
            except Exception:  # a failing tick is logged and retried, never fatal
                log.exception("runtime tick failed")
            await asyncio.sleep(self.cfg.tick)

    async def _heartbeat(self) -> None:
        """Plane ticks (heartbeats, membership, gossiped certificates) and the status file. When
        peers announce a newer version that gossip did not bring (a certificate too large for a
        gossip message, ADR 0047), its certificate is fetched from them."""
        follow: asyncio.Task[None] | None = None
        while True:
            try:
                heard = await self.plane.tick(self._presence())
                for raw in heard:
                    self._certs_in.put_nowait((raw, None))
                polling = follow is not None and not follow.done()
                idle = (
                    not (heard or polling or self._apply_lock.locked()) and self._certs_in.empty()
                )
                if idle and self.plane.peers_holding(self.chain.version + 1):
                    if follow is not None:
                        self._tasks.remove(follow)
                    follow = asyncio.create_task(self._poll_certificate(self.chain.version + 1))
                    self._tasks.append(follow)
                await self.write_status()
            except Exception:  # a failing interval is logged and retried, never fatal
                log.exception("heartbeat interval failed")
            await asyncio.sleep(self.cfg.heartbeat)

    def _presence(self) -> Presence:
        tv = self.trainer_view()
        tps = float(getattr(tv, "tokens_per_second", 0.0) or 0.0)
        return Presence(self.chain.version, self._roles(), tps, self.view.stalled_s)

    def _roles(self) -> tuple[str, ...]:
        svc = self.service
        on = svc is not None and svc.committee is not None and self.me in svc.committee.members
        learner = ("learner",) if self.deliver is not None else ()
        return (*learner, "syncer") if on else learner or ("learner",)

    async def _applier(self) -> None:
        """Apply certificates one at a time, newest of each batch first."""
        while True:
            items = [await self._certs_in.get()]
            while not self._certs_in.empty():
                items.append(self._certs_in.get_nowait())
            for raw, computed in sorted(items, key=lambda it: -cert_version(it[0])):
                if cert_version(raw) <= self.chain.version:
                    continue
                try:
                    await self._apply(raw, computed)
                except (InvalidRecord, SyncError, RpcError, TimeoutError) as e:
                    log.warning("could not apply a certificate: %s", e)
                    if isinstance(e, SyncError):  # holders may still be installing it
                        self._retry_later(raw)
                except Exception:
                    log.exception("applying a certificate failed")

    async def _apply(self, raw: bytes, computed: CertifiedState | None) -> None:
        async with self._apply_lock:
            if cert_version(raw) > self.chain.version:
                await self._apply_locked(raw, computed)

    async def _apply_locked(self, raw: bytes, computed: CertifiedState | None) -> None:
        target = parse_certificate(raw, run_id=self.run_id)
        chain = await catch_up(
            self.transport,
            self.run_id,
            self.manifest,
            self.chain.cert,
            target,
            lambda v: self._holders(target, v),
        )
        cert = chain[-1]  # below target if target's chain does not verify (its claim ignored)
        new = await obtain_state(
            self.transport,
            self.manifest,
            self.chain.current,
            chain,
            computed,
            self._holders,
            self.tally,
        )
        # Serve it at once (peers download from the signers), then make it durable.
        self.chain.add_certs(chain)
        self.chain.install(new)
        # Counted with the version it comes with, before any await: a view published meanwhile
        # (a heartbeat) would show the new version with the old counts.
        merged, rejected = self.tally.record_chain(chain, self.me)
        assert self.service is not None
        await self.service.install(new)
        await asyncio.get_running_loop().run_in_executor(None, self.chain.persist, chain, new)
        self._retries.clear()
        self._settle_pending(new.version)
        if self.deliver is not None:
            self.deliver(Certified(new, frozenset(merged), rejected=frozenset(rejected)))
        await self.plane.publish_certificate(cert)
        self.tally.phase = "training" if self.deliver is not None else "serving"
        self.tally.event(
            f"applied version {new.version} (committee "
            f"{', '.join(m[-8:] for m in cert.body.committee)}; {len(cert.body.accepted)} deltas "
            f"merged{', ours among them' if any(a.peer_id == self.me for a in cert.body.accepted) else ''})"
        )
        assert self._loop is not None
        self.evaluator.spawn(new, self._loop)
        self._publish_view()
        await self.write_status()

    async def _committee_state(self, state: CertifiedState) -> CertifiedState:
        """``state`` with the committee state this node is to merge on (ADR 0064), which the
        chain then serves in its place."""
        full = await committee_state(self.transport, state, self._holders, self.tally)
        self.chain.complete(full)
        return full

    def _retry_later(self, raw: bytes, delay: float = 1.0) -> None:
        """Try a certificate again shortly, at most ``MAX_RETRIES`` times (a forged one that
        no chain reaches must not be retried forever)."""
        key = (cert_version(raw), hash(raw))
        tries = self._retries.get(key, 0)
        if tries >= MAX_RETRIES or len(self._retries) >= 64:
            return
        self._retries[key] = tries + 1
        assert self._loop is not None
        self._loop.call_later(delay * (tries + 1), self._certs_in.put_nowait, (raw, None))

    def _settle_pending(self, version: int) -> None:
        if self._pending is not None and self._pending.sub.base_version < version:
            self._pending = None

    def _holders(self, cert: Certificate, version: int | None = None) -> list[str]:
        """Peers likely to hold ``cert`` and its state: its signers, then anyone announcing it;
        for an earlier ``version`` of its chain, those announcing that version come first."""
        v = cert.body.version if version is None else version
        near = self.plane.peers_holding(v)
        signers = [s for s in cert.signers if s != self.me and s not in near]
        return signers + near if v == cert.body.version else near + signers

    async def _sender(self) -> None:
        """Deliver each sealed submission to the committee of its base version + 1."""
        while True:
            sub = await self._outbox.get()
            self._pending = pending = _Pending(sub, Delivery(sub.digest, self.me))
            self.tally.on_sent()
            try:
                await self._deliver(pending, Committee(self._committee_now()), first=True)
            except Exception:
                log.exception("sending a submission failed")

    async def _deliver(self, pending: _Pending, event: DeliveryEvent, first: bool = False) -> None:
        """Feed the delta's delivery machine (``core.delivery``) ``event`` and carry out what it
        says until the delivery under way ends: uploads (``submit_to``, a pass's at once),
        back-offs, messages to the trainer, the pause reason. A certificate above the delta's
        base, or a newer delta, settles it, but a new delta's ``first`` pass always goes out:
        a member judges a stale base (STALE, with the version to fetch)."""
        loop = asyncio.get_running_loop()
        machine = pending.machine
        effects = deque(machine.handle(event, loop.time()))
        sent = False
        pending.delivering = True
        try:
            while effects:
                e = effects.popleft()
                if isinstance(e, (Send, Wait)) and not first and self._settled(pending):
                    effects = deque(machine.handle(Settled(), loop.time()))
                elif isinstance(e, Send):
                    sent, first = True, False
                    replies = await asyncio.gather(
                        *(
                            submit_to(self.transport, self.service, self.me, p, pending.sub)
                            for p in e.peers
                        )
                    )
                    machine.handle(Committee(self._committee_now()), loop.time())  # next pass's
                    for peer, (status, code, hint) in zip(e.peers, replies, strict=True):
                        if status == "rejected" and code not in RETRYABLE:
                            self.tally.event(f"delta refused by {peer[-8:]}: {code}")
                        effects += machine.handle(Answer(peer, status, code, hint), loop.time())
                elif isinstance(e, Wait):
                    await asyncio.sleep(max(0.0, e.until - loop.time()))
                    effects += machine.handle(Timer(), loop.time())
                else:
                    self._carry_out(pending, e)
        finally:
            pending.delivering = False
        if sent:
            holders = len(machine.holders)
            log.info(
                "submitted delta on version %d to %d syncers: %d accepted for merging",
                pending.sub.base_version,
                len(machine.statuses),
                holders,
            )

    def _carry_out(self, pending: _Pending, e: DeliveryEffect) -> None:
        """A message to the trainer, or the pause reason."""
        if isinstance(e, Pause):
            self.tally.paused_reason = e.reason
        elif isinstance(e, Tell) and self.deliver is not None:
            digest = pending.sub.digest
            if e.verdict is Verdict.DROPPED:
                if self._pending is not pending:
                    return
                self._pending = None
                self.tally.event(f"delta on version {pending.sub.base_version} dropped: {e.code}")
                assert e.code is not None
                self.deliver(Dropped(digest, e.code))
            else:
                self.deliver(Reply(digest, e.verdict is Verdict.ACCEPTED, e.code, e.hint))

    def _settled(self, pending: _Pending) -> bool:
        return self.chain.version > pending.sub.base_version or self._pending is not pending

    def _committee_now(self) -> tuple[str, ...]:
        """The committee a submission on the current version goes to: that of the view this
        node knows of, or expects after as many view timeouts without a certificate."""
        st = self.service.views.state if self.service is not None else None
        if st is None:
            return committee_for(self.run_id, self.manifest, self.chain.cert).members
        return st.committee(st.expected_view(time.monotonic())).members

    async def _poller(self) -> None:
        """While a delta is in flight: offer it to a later view's committee (the machine says
        whether), ask the committee for the next certificate and the holders whether our
        submission is still pending (a dropped one is reported to the trainer)."""
        while True:
            await asyncio.sleep(self.cfg.poll)
            pending = self._pending
            if pending is None or self._settled(pending):
                continue
            try:
                if not pending.delivering:
                    await self._deliver(pending, Committee(self._committee_now()))
                await self._poll_certificate(pending.sub.base_version + 1)
                await self._poll_receipt(pending)
            except Exception:
                log.exception("polling failed")

    async def _poll_certificate(self, version: int) -> None:
        peers = [m for m in self._committee_now() if m != self.me]
        peers += [p for p in self.plane.peers_holding(version) if p not in peers]
        for peer in peers[:6]:
            try:
                raw = await fetch_cert(self.transport, peer, version)
            except RpcError:
                continue
            self._certs_in.put_nowait((raw, None))
            return

    async def _poll_receipt(self, pending: _Pending) -> None:
        """Ask each holder the machine names, one at a time, until one still holds the delta
        or cannot be reached (then it is assumed still pending)."""
        loop = asyncio.get_running_loop()
        for poll in pending.machine.handle(ReceiptDue(), loop.time()):
            assert isinstance(poll, PollReceipt)
            args = {"digest": pending.sub.digest}
            for peer in poll.peers:
                try:
                    if peer == self.me:
                        assert self.service is not None
                        reply, _ = await self.service.handle("receipt", self.me, args, [])
                    else:
                        reply, _ = await self.transport.call(peer, "receipt", args=args, timeout=10)
                except (RpcError, RpcRefused):
                    return
                dropped = reply.get("status") == "dropped"
                code = Reason.parse(reply.get("code")) if dropped else None
                for e in pending.machine.handle(Receipt(peer, dropped, code), loop.time()):
                    self._carry_out(pending, e)
                if not dropped:
                    return

    async def _claims_from_network(self) -> list[bytes]:
        """At start: the newest certificates above ours in the DHT or held by live peers (at
        most 4, newest first); each is believed only once its chain verifies."""
        found = await self.plane.read_certificates()
        for peer in self.plane.peers_holding(self.chain.version + 1)[:3]:
            with contextlib.suppress(RpcError):
                found.append(await fetch_cert(self.transport, peer, -1))
        claims = signed_claims(found, self.run_id, above=self.chain.version)[:4]
        for raw in claims[:1]:
            v = (self.chain.version, cert_version(raw))
            log.info("catching up from version %d (newest claim %d: believed once verified)", *v)
        return claims

    # -- views ---------------------------------------------------------------------------------

    def _publish_view(self) -> None:
        svc = self.service
        committee = svc.committee if svc is not None else None
        self.view = self.tally.view(
            version=self.chain.version,
            committee=committee.members if committee is not None else (),
            committee_version=committee.version if committee is not None else 0,
            me=self.me,
            rejections=tuple(svc.rejections) if svc is not None else (),
            statuses=self._pending.machine.statuses if self._pending is not None else None,
        )

    async def write_status(self) -> None:
        data = self.view.status_json(self.me, self.run_id, self.trainer_view(), TRAFFIC)
        path = self.cfg.state_dir / "status.json"
        await asyncio.get_running_loop().run_in_executor(None, write_quietly, path, data)

    def write_final_status(self) -> None:
        """After ``close`` (its tasks are gone, so any thread may do this): the last view and
        status file."""
        self._publish_view()
        data = self.view.status_json(self.me, self.run_id, self.trainer_view(), TRAFFIC)
        write_quietly(self.cfg.state_dir / "status.json", data)
