"""The asyncio driver of one node's syncer duty: the sans-IO ``SyncerRound`` on the runtime loop.

When the node sits on the committee of the next version, this feeds the round with what
arrives (submissions, the leader's proposal, fellow syncers' signatures, clock ticks) and
carries out the actions it returns: reject (logged with the peer id and a ``Reason`` code),
propose, fetch, merge (``sync.certified.next_state`` in a worker thread), sign, assemble the
certificate. Every rule that changes certified bytes comes from the signed manifest
(``manifest.rules``); nothing local does. A merge that fails starts the round's next attempt
instead of leaving it stuck. Every per-peer and per-submission structure is bounded. All
methods run on the runtime's loop; nothing here is called from another thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from functools import partial
from typing import Any

from p2pdiloco import failpoints
from p2pdiloco.aio import cancel_and_wait
from p2pdiloco.core.arrivals import ArrivalWindow
from p2pdiloco.core.bounded import BoundedLog, ReplayGuard
from p2pdiloco.core.delivery import fetch_order
from p2pdiloco.core.roster import CommitteeInfo, with_roster
from p2pdiloco.core.round import (
    Action,
    Aggregate,
    Clipped,
    Done,
    Dropped,
    FastForward,
    Fetch,
    Propose,
    Reject,
    Sign,
    Submission,
    SyncerRound,
)
from p2pdiloco.core.trust import learners_awaited
from p2pdiloco.net.sync_rpc import RpcError, RpcRefused
from p2pdiloco.net.transport import Transport
from p2pdiloco.protocol.certificates import content_digest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import RETRYABLE, Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.protocol.submissions import ParsedSubmission, open_submission
from p2pdiloco.sync.aggregator import MergeError, MergeInput, MergeResult
from p2pdiloco.sync.certified import CertifiedState, next_state
from p2pdiloco.sync.committee_msgs import (
    BadMessage,
    certificate_body,
    open_proposal,
    open_signature,
    seal_proposal,
)
from p2pdiloco.sync.fetch import fetch_submission
from p2pdiloco.sync.intake import Held, Intake, Refusal
from p2pdiloco.sync.relay import Relayer
from p2pdiloco.sync.rules import round_params
from p2pdiloco.sync.sending import Fellows, still_proposing, still_signing
from p2pdiloco.sync.signatures import RoundSignatures, refusal_of
from p2pdiloco.sync.view_driver import ViewDriver
from p2pdiloco.train.outer import OuterConfig

log = logging.getLogger(__name__)

MAX_BUFFERED = 256  # early proposals/signatures kept for a round this syncer has not opened
MAX_REJECTIONS_KEPT = 1000
MAX_FAST_FORWARD_KEPT = 4096


class SyncService:
    def __init__(
        self,
        identity: Identity,
        run_id: str,
        manifest: RunManifest,
        shapes: Mapping[str, tuple[int, ...]],
        transport: Transport,
        *,
        live_learners: Callable[[], Collection[str]],
        on_certified: Callable[[bytes, CertifiedState | None], None],
    ) -> None:
        self.identity = identity
        self.me = identity.peer_id
        self.run_id = run_id
        self.manifest = manifest
        self.rules = manifest.rules
        self.intake = Intake(manifest, shapes, run_id, self._reject)
        self.max_payload = self.intake.max_payload
        self.relayer = Relayer(transport, current=lambda: self.round)  # queued on the uplink
        self.screen = self.relayer.screening(self.intake, lambda: self.round)  # header only
        self.transport = transport
        self.live_learners = live_learners
        self.on_certified = on_certified
        self.outer = OuterConfig(**manifest.outer.model_dump())  # lr, momentum, nesterov, P
        self.current: CertifiedState | None = None
        self.committee: CommitteeInfo | None = None
        self.round: SyncerRound | None = None
        self.held: dict[str, Held] = {}  # bounded by the round's max_inputs
        self.seen = ReplayGuard.for_staleness(self.rules.staleness)
        self.fast_forward: dict[str, int] = {}
        self.signatures = RoundSignatures()  # this round's bodies, signatures, merged states
        self.buffered: list[tuple[int, str, str, list[bytes]]] = []
        self.rejections: BoundedLog[dict[str, Any]] = BoundedLog(MAX_REJECTIONS_KEPT)
        self.clipped = 0  # submissions counted with a clipped claim (plausible_claim)
        self.arrivals = ArrivalWindow(self.rules.grace, self.rules.grace_min)  # adaptive grace
        self._tasks: set[asyncio.Task[Any]] = set()
        call = transport.call
        self.fellows = Fellows(  # who answers and who is gone, told to the round (ADR 0041)
            lambda p, o, f: call(p, o, frames=f), lambda: self.round, self._others
        )
        self.views = ViewDriver(identity, run_id, manifest, self.fellows.send, self._spawn)

    # -- lifecycle -------------------------------------------------------------------------------

    async def install(self, state: CertifiedState) -> None:
        """A newly certified (or genesis, or downloaded) version: open the next round if this
        node is on its committee."""
        if self.current is not None and state.version <= self.current.version:
            return
        self.current = state
        self.seen.advance(state.version)
        self.held.clear()
        self.signatures.clear()
        self.fast_forward.clear()
        self.views.reset(state.cert, time.monotonic())
        self._open_view([])
        early = [b for b in self.buffered if b[0] == state.version + 1]
        self.buffered = [b for b in self.buffered if b[0] > state.version + 1]
        for _, op, peer, frames in early:
            try:
                await self.handle(op, peer, {}, frames)
            except RpcRefused as e:
                log.info("buffered %s from %s refused: %s", op, peer, e)

    def _open_view(self, carry: list[Held]) -> None:
        """Open the round of the node's current view if it sits on that view's committee, with
        the submissions it held in the view before (still for the same base version); a view
        bound to an earlier view's lock opens on exactly that input set and fetches what it
        lacks from the lock's signers. Off the committee, it keeps serving what it holds."""
        st = self.views.state
        assert self.current is not None and st is not None
        self.committee, self.round = st.committee(), None
        if self.me not in self.committee.members:
            return
        locked = st.locked_inputs()
        if st.lock is not None and locked is None:
            log.error("view %d of version %d is locked on %s, whose inputs this node has not "
                      "heard: it waits for them", st.view, st.version, st.lock[:12])  # fmt: skip
            return
        active, trusted = learners_awaited(self.manifest, self.current.cert, self.live_learners())
        params = round_params(self.run_id, self.manifest, self.current, self.committee, active,
                              time.monotonic(), locked, self.arrivals.next_round(), trusted,
                              self.intake.max_inputs)  # fmt: skip
        self.round = rnd = SyncerRound(params, self.me)
        self.held.clear()
        log.info(
            "on the committee for version %d, view %d (%d members, quorum %d)%s",
            st.version, st.view, len(self.committee.members), self.committee.quorum,
            "" if locked is None else f", re-certifying {st.lock[:12] if st.lock else ''}",
        )  # fmt: skip
        for held in carry:
            if locked is not None and held.sub.digest not in locked:
                continue
            held.fetched = True  # its learner re-sends it to this view: that copy is no replay
            actions = rnd.on_submission(self._submission(held.sub), time.monotonic())
            if not any(isinstance(a, Reject) for a in actions):
                self.held[held.sub.digest] = held
            self._execute(actions, held.sub.digest)
        missing = tuple(d for d in locked or () if d not in rnd.accepted)
        if missing:
            holders = [h for h in st.holders() if h != self.me]  # the voters that signed the lock
            self._spawn(self._fetch(missing, lambda d: holders))

    def _enter_view(self) -> None:
        """The node moved to a later view of the same version (its votes proved the timeout)."""
        carry = list(self.held.values())
        self.signatures.clear()
        self._open_view(carry)

    def tick(self) -> None:
        now = time.monotonic()
        if self.views.tick(now, self.round, self.signatures.bodies):
            self._enter_view()
        if self.round is not None:
            self._execute(self.round.on_tick(now))

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks), "sync service")

    # -- requests --------------------------------------------------------------------------------

    async def handle(
        self, op: str, peer: str, control: dict[str, Any], frames: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        if op == "submit":
            return await self._on_submit(peer, frames, control.get("relay") is True)
        if op == "propose":
            return self._on_proposal(peer, frames)
        if op == "sign":
            return self._on_signature(peer, frames)
        if op == "vote":
            return self._on_vote(peer, frames)
        if op == "fetch":
            held = self.held.get(str(control.get("digest")))
            if held is None or failpoints.hit("serve_fetch"):
                raise RpcRefused(Reason.NOT_FOUND, "no such submission here")
            return {}, [held.raw, held.payload]
        if op == "receipt":
            return self._on_receipt(str(control.get("digest", ""))), []
        raise RpcRefused(Reason.UNKNOWN_OP, f"unknown op {op[:32]!r}")

    def _on_receipt(self, digest: str) -> dict[str, Any]:
        """Where a learner's submission stands in this syncer's round."""
        return self.round.status_of(digest).reply() if self.round else {"status": "unknown"}

    async def _on_submit(
        self, stream_peer: str, frames: list[bytes], pass_on: bool = False
    ) -> tuple[dict[str, Any], list[bytes]]:
        raw, rest = (frames[0] if frames else b""), frames[1:]
        try:
            sub = open_submission(raw, run_id=self.run_id)
        except InvalidRecord as e:
            self._reject(e.signer or stream_peer, None, Reason.INVALID_SIGNATURE, str(e))
            raise RpcRefused(Reason.INVALID_SIGNATURE, f"invalid submission: {e}") from None
        held = self.held.get(sub.digest)
        if held is not None:
            # Held already: the learner's own copy after a fellow syncer's (fetched), or the
            # same submission sent again because the reply to the first was lost. Either way
            # it is in this round once; answering as the first time makes a resend idempotent.
            held.fetched = False
            return {"status": "accepted", "version": sub.header.base_version + 1}, []
        refusal = await self._check(sub, rest[0] if rest else None)
        if refusal is not None:
            code, text = refusal
            if code not in RETRYABLE:
                self._reject(sub.envelope.signer, sub.digest, code, text)
            return {"status": "rejected", "code": code.value, "reason": text}, []
        assert self.current is not None and rest
        h = sub.header
        # Seen (a later copy is a replay) once a round judged it, not when refused with a code
        # asking for a retry (NO_OPEN_ROUND, BUSY): an honest retry was logged as "replayed".
        if self.round is None:
            later = self.views.state is not None and self.views.state.member_soon()
            code = Reason.NO_OPEN_ROUND if later else Reason.NOT_ON_COMMITTEE  # later: retry
            text = f"not on the committee of this view of version {self.current.version + 1}"
            ff = self.current.version if h.base_version < self.current.version else None
            return {"status": "rejected", "code": code.value, "reason": text,
                    "fast_forward": ff}, []  # fmt: skip
        rnd, now = self.round, time.monotonic()
        relaying = pass_on and stream_peer == h.peer_id and rnd.undecided  # to pass on
        if relaying and (busy := self.relayer.busy(rnd, now)):  # its own learner's: no screen
            return {"status": "rejected", "code": Reason.BUSY.value, "reason": busy}, []
        actions = rnd.on_submission(self._submission(sub), now)
        rejected = [a for a in actions if isinstance(a, Reject) and a.peer_id == h.peer_id]
        if not rejected or rejected[0].code not in RETRYABLE:
            self.seen.add(sub.digest, h.base_version)
        if not rejected:
            self.held[sub.digest] = Held(sub, raw, rest[0])
            self.arrivals.arrived(time.monotonic() - rnd.params.opened_at)
            if relaying:
                still = lambda: self.round is rnd and rnd.undecided  # noqa: E731
                self._spawn(self.relayer.relay(self._others(), raw, rest[0], still))
        self._execute(actions, sub.digest)
        if rejected:
            no = rejected[0]
            return {"status": "rejected", "code": no.code.value, "reason": no.reason,
                    "fast_forward": self.fast_forward.pop(h.peer_id, None)}, []  # fmt: skip
        clipped = any(isinstance(a, Clipped) for a in actions)  # counted with a smaller claim
        return {"status": "accepted", "version": self.current.version + 1, "clipped": clipped}, []

    def _submission(self, sub: ParsedSubmission) -> Submission:
        h = sub.header
        return Submission(h.peer_id, self.run_id, h.base_version, h.steps, h.tokens, sub.digest)

    async def _check(self, sub: ParsedSubmission, payload: bytes | None) -> Refusal | None:
        version = self.current.version if self.current is not None else None
        return await self.intake.check(sub, payload, version, self.seen)

    def _on_proposal(self, peer: str, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        try:
            prop = open_proposal(frames[0] if frames else b"", self.run_id)
        except BadMessage as e:
            self._reject(e.signer or peer, None, e.code, str(e))
            raise RpcRefused(e.code, str(e)) from None
        if self._buffer_if_early(prop.version, "propose", peer, frames):
            return {"buffered": True}, []
        rnd, view = self.round, self._view
        if rnd is None or self.current is None or prop.version != self.current.version + 1:
            raise RpcRefused(Reason.NO_OPEN_ROUND, f"no open round for version {prop.version}")
        if prop.view != view:  # a later view: retry once this node is in it; an earlier: over
            code = Reason.NO_OPEN_ROUND if prop.view > view else Reason.ROUND_CLOSED
            raise RpcRefused(code, f"proposal for view {prop.view}; this syncer is in {view}")
        fresh = rnd.input_set is None
        actions = rnd.on_proposal(prop.signer, prop.digests, time.monotonic(), prop.attempt)
        refused = [a for a in actions if isinstance(a, Reject) and a.peer_id == prop.signer]
        self._execute(actions)
        if refused:
            raise RpcRefused(refused[0].code, refused[0].reason)
        if fresh and rnd.input_set is not None:  # adopted: pass it on, the leader may be gone
            self._spawn(self.fellows.to_all("propose", frames[0], skip={peer, prop.signer}))
        return {}, []

    def _on_signature(self, peer: str, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        try:
            signer, body, sig = open_signature(frames[0] if frames else b"")
        except BadMessage as e:
            self._reject(peer, None, e.code, str(e))
            raise RpcRefused(e.code, str(e)) from None
        if self._buffer_if_early(body.version, "sign", peer, frames):
            return {"buffered": True}, []
        if self.round is None or self.current is None or body.version != self.current.version + 1:
            raise RpcRefused(Reason.NO_OPEN_ROUND, f"no open round for version {body.version}")
        p = self.round.params
        if (no := refusal_of(body, self.run_id, p.version, self._view, p.committee)) is not None:
            if no[0] is Reason.WRONG_COMMITTEE:
                self._reject(signer, None, *no)
            raise RpcRefused(*no)
        digest = self.signatures.add(signer, body, sig, len(self.round.params.committee))
        self._execute(self.round.on_signature(signer, digest))
        return {}, []

    def _on_vote(self, peer: str, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        try:
            moved = self.views.on_vote(frames[0] if frames else b"", time.monotonic())
        except BadMessage as e:
            self._reject(peer, None, e.code, str(e))
            raise RpcRefused(e.code, str(e)) from None
        if moved:
            self._enter_view()
        return {}, []

    def _buffer_if_early(self, version: int, op: str, peer: str, frames: list[bytes]) -> bool:
        current = self.current.version if self.current is not None else -1
        if current + 1 < version <= current + 3 and len(self.buffered) < MAX_BUFFERED:
            self.buffered.append((version, op, peer, frames))
            return True
        return False

    # -- actions -----------------------------------------------------------------------------

    def _execute(self, actions: list[Action], context: str | None = None) -> None:
        for a in actions:
            if isinstance(a, Reject):
                self._reject(a.peer_id, context, a.code, a.reason)
            elif isinstance(a, Clipped):
                self._record_clip(a)
            elif isinstance(a, FastForward):
                if len(self.fast_forward) < MAX_FAST_FORWARD_KEPT:
                    self.fast_forward[a.peer_id] = a.to_version
            elif isinstance(a, Propose):
                self._spawn(self._propose(a.digests, a.attempt))
            elif isinstance(a, Fetch):
                members = self.committee.members if self.committee else ()
                order = partial(fetch_order, members=members, me=self.me, proposer=a.from_peer)
                self._spawn(self._fetch(a.digests, order))
            elif isinstance(a, Aggregate):
                self._spawn(self._aggregate(a))
            elif isinstance(a, Sign):
                msg = self.signatures.message(self.me, a.state_hash)  # "later": while uncertified
                live = partial(still_signing, lambda: self.round, self.round)
                self._spawn(self.fellows.to_all("sign", msg, later_while=live))
            elif isinstance(a, Dropped):
                for d in a.digests:
                    self.held.pop(d, None)
            elif isinstance(a, Done):
                self._finish(a)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("sync task failed: %r", task.exception())

    @property
    def _view(self) -> int:
        return self.views.state.view if self.views.state is not None else 0

    def _others(self) -> list[str]:
        assert self.committee is not None
        return [m for m in self.committee.members if m != self.me]

    async def _propose(self, digests: tuple[str, ...], attempt: int) -> None:
        assert self.current is not None and self.round is not None
        rnd, version = self.round, self.current.version + 1
        view = self._view
        raw = seal_proposal(self.identity, self.run_id, version, attempt, digests, view)
        log.info("proposing %d submissions for version %d (attempt %d)", len(digests), version,
                 attempt)  # fmt: skip
        live = partial(still_proposing, lambda: self.round, rnd, attempt)  # fellows not in it yet
        await self.fellows.to_all("propose", raw, later_while=live)

    async def _fetch(self, digests: tuple[str, ...], holders: Callable[[str], list[str]]) -> None:
        """Fetch agreed inputs this syncer lacks, each from its ``holders`` in turn, retried."""
        rnd = self.round
        for d in digests:
            if rnd is None or d in rnd.accepted:
                continue
            try:
                frames = await fetch_submission(self.transport, d, holders(d), self.max_payload)
                version = self.current.version if self.current is not None else None
                sub = await self.intake.open_fetched(d, frames, version, self.seen)
            except (RpcError, InvalidRecord) as e:
                log.warning("could not fetch submission %s: %s", d[:12], e)
                continue
            if rnd is not self.round or rnd is None:
                return
            self.seen.add(d, sub.header.base_version)
            self.held[d] = Held(sub, frames[0], frames[1], fetched=True)
            self._execute(rnd.on_fetched(self._submission(sub)), d)

    async def _aggregate(self, action: Aggregate) -> None:
        rnd, base, committee = self.round, self.current, self.committee
        assert rnd is not None and base is not None and committee is not None
        inputs = [
            (d, self.held[d].sub.header.peer_id, self.held[d].payload, w, a)
            for d, w, a in zip(action.digests, action.weights, action.anchors(), strict=True)
        ]
        loop = asyncio.get_running_loop()
        try:
            result, state = await loop.run_in_executor(None, self._merge, base, inputs)
        except Exception as e:  # screened out entirely, or a local fault: next attempt
            log.error("round %d: merge failed (%s); starting the next attempt", base.version + 1, e)
            if rnd is self.round:
                screened = tuple(e.rejected) if isinstance(e, MergeError) else ()
                self._execute(
                    rnd.on_merge_failed(time.monotonic(), attempt=action.attempt,
                                        screened_out=screened)
                )  # fmt: skip
            return
        if rnd is not self.round:
            return
        headers = {d: self.held[d].sub.header for d in action.digests}
        for d, r in sorted(result.rejected.items()):
            self._reject(headers[d].peer_id, d, Reason.SCREENED_OUT, f"screened out: {r}")
        view = self._view
        body = certificate_body(
            self.run_id, self.manifest, base, committee, state.state_hash, headers,
            result.accepted, result.rejected, view=view, update_hash=state.update_hash,
        )  # fmt: skip
        lock = self.views.state.lock if self.views.state is not None else None
        if lock is not None and content_digest(body) != lock:
            log.error("version %d: merge differs from the locked content %s; not signing",
                      body.version, lock[:12])  # fmt: skip
            return
        digest = self.signatures.own(self.identity, body, state)
        log.info(
            "merged version %d: %d accepted, %d screened out (%s), state %s",
            body.version,
            len(result.accepted),
            len(result.rejected),
            result.rule,
            state.state_hash[:12],
        )
        self._execute(rnd.on_aggregated(digest, attempt=action.attempt))

    def _merge(
        self, base: CertifiedState, inputs: list[tuple[str, str, bytes, float, bool]]
    ) -> tuple[MergeResult, CertifiedState]:
        decode = self.intake.decode
        merge_inputs = [MergeInput(d, p, decode(b, base.version), w, a) for d, p, b, w, a in inputs]
        return next_state(base, merge_inputs, self.rules, self.outer)

    def _finish(self, done: Done) -> None:
        tcs = tuple(self.views.state.tcs) if self.views.state is not None else ()
        raw, cert, state = self.signatures.certificate(
            done.state_hash, done.signers, tcs, self.run_id
        )
        if state is not None:  # merged here, so the roster is the one this member derived
            assert self.current is not None
            state.cert = cert = with_roster(self.manifest, self.current.cert, cert)
        late = "" if done.agreed_with_quorum else " (this syncer's merge differed, failed or late)"
        log.info("version %d certified by %d/%d syncers (view %d)%s", cert.body.version,
                 len(done.signers), len(cert.body.committee), cert.body.view, late)  # fmt: skip
        self.on_certified(raw, state)

    def _record_clip(self, clip: Clipped) -> None:
        self.clipped += 1
        (s, t), (ks, kt) = clip.claimed, clip.counted
        text = f"claim of {s} steps / {t} tokens clipped to {ks} / {kt} (counted, not refused)"
        self._reject(clip.peer_id, clip.digest, Reason.BAD_CLAIM, text)

    def _reject(self, peer: str, digest: str | None, code: Reason, reason: str) -> None:
        log.warning("rejected input from %s: [%s] %s", peer, code.value, reason)
        version = self.current.version + 1 if self.current is not None else None
        self.rejections.append(
            {"peer_id": peer, "digest": digest, "code": code.value, "reason": reason[:300],
             "round": version}
        )  # fmt: skip
