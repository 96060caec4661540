"""The asyncio driver of one node's syncer duty: the sans-IO ``SyncerRound`` on the runtime loop.

What the node decides as a (possible) committee member is its ``SyncerNode``'s
(``core/syncer_node.py``: held, seen and buffered submissions, fast-forward hints, which view's
round is open and what it carries; ``core/views.py``: when to vote). This interpreter checks
what arrives (signatures, payloads), feeds the node and its round (submissions, the leader's
proposal, fellow syncers' signatures, votes, clock ticks) and carries out what they return:
reject (logged with the peer id and a ``Reason`` code), relay, propose, fetch, merge
(``sync.certified.next_state`` in a worker thread), sign, vote, assemble the certificate. Every rule that changes certified bytes comes from the signed manifest
(``manifest.rules``); nothing local does. A merge that fails starts the round's next attempt
instead of leaving it stuck. Every per-peer and per-submission structure is bounded. All
methods run on the runtime's loop; nothing here is called from another thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Coroutine, Mapping
from functools import partial
from typing import Any

from p2pdiloco import failpoints
from p2pdiloco.aio import cancel_and_wait
from p2pdiloco.core.bounded import BoundedLog
from p2pdiloco.core.delivery import fetch_order
from p2pdiloco.core.roster import CommitteeInfo, genesis_roster, with_roster
from p2pdiloco.core.round import (
    Action,
    Aggregate,
    Clipped,
    Done,
    Evaluated,
    Fetch,
    Propose,
    Reject,
    RoundParams,
    Sign,
    Submission,
    SyncerRound,
)
from p2pdiloco.core.syncer_node import Held, Seating, SyncerNode
from p2pdiloco.core.trust import learners_awaited, trusted_peers
from p2pdiloco.net.sync_rpc import RpcError, RpcRefused
from p2pdiloco.net.transport import Transport
from p2pdiloco.protocol.certificates import CertificateBody, content_digest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import RETRYABLE, Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.protocol.submissions import ParsedSubmission, open_submission
from p2pdiloco.sync.aggregator import MergeError, MergeInput, MergeResult
from p2pdiloco.sync.certified import CertifiedState, certified_params_hash, next_state
from p2pdiloco.sync.committee_msgs import (
    BadMessage,
    certificate_body,
    open_proposal,
    open_signature,
    seal_proposal,
)
from p2pdiloco.sync.fetch import SyncError, fetch_submission
from p2pdiloco.sync.held_out import HeldOutEval
from p2pdiloco.sync.intake import Intake, Received, Refusal
from p2pdiloco.sync.relay import Relayer
from p2pdiloco.sync.rules import round_params
from p2pdiloco.sync.scoring import WorkCheck, WorkScorer
from p2pdiloco.sync.sending import Fellows, still_proposing, still_signing
from p2pdiloco.sync.signatures import RoundSignatures, refusal_of
from p2pdiloco.sync.stopping import MergeStopped
from p2pdiloco.sync.update import UpdateError, decode_update, rules_codec
from p2pdiloco.sync.view_driver import ViewDriver
from p2pdiloco.train.outer import OuterConfig

log = logging.getLogger(__name__)

MAX_REJECTIONS_KEPT = 1000

Early = tuple[str, str, list[bytes]]  # a committee message before its round: op, peer, frames


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
        held_out: HeldOutEval | None = None,
        committee_state: Callable[[CertifiedState], Coroutine[Any, Any, CertifiedState]]
        | None = None,
        scorer: WorkScorer | None = None,
    ) -> None:
        """``scorer``: what scores deltas for work (``sync.scoring``) when the manifest asks
        for it (``rules.work``); a syncer without one cannot merge such a run's rounds."""
        self.identity = identity
        self.scorer = scorer
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
        self.held_out = held_out  # the eval step of a run that certifies an eval loss (ADR 0059)
        # Completes a state held without its committee state (a follower of "params" updates,
        # ADR 0064) before this node merges on it; None: states always hold it.
        self.committee_state = committee_state
        self._completing: tuple[int, asyncio.Task[CertifiedState]] | None = None
        self.outer = OuterConfig(**manifest.outer.model_dump())  # lr, momentum, nesterov, P
        self.current: CertifiedState | None = None
        self.node: SyncerNode[Received, Early] = SyncerNode(self.me, run_id, manifest)
        self.signatures = RoundSignatures()  # this round's bodies, signatures, merged states
        self.rejections: BoundedLog[dict[str, Any]] = BoundedLog(MAX_REJECTIONS_KEPT)
        self.clipped = 0  # submissions counted with a clipped claim (plausible_claim)
        self._tasks: set[asyncio.Task[Any]] = set()
        call = transport.call
        self.fellows = Fellows(  # who answers and who is gone, told to the round (ADR 0041)
            lambda p, o, f: call(p, o, frames=f),
            lambda: self.round,
            self._others,
            behind=self._catch_up,  # a fellow in an earlier view
        )
        views = lambda: self.node.views  # noqa: E731
        self.views = ViewDriver(identity, run_id, views, self.fellows.send, self._spawn)

    @property
    def round(self) -> SyncerRound | None:
        return self.node.round

    @property
    def committee(self) -> CommitteeInfo | None:
        return self.node.committee

    @property
    def held(self) -> dict[str, Held[Received]]:
        return self.node.held

    # -- lifecycle -------------------------------------------------------------------------------

    async def install(self, state: CertifiedState) -> None:
        """A newly certified (or genesis, or downloaded) version: open the next round if this
        node is on its committee."""
        early = self.node.install(state.cert, state.version, time.monotonic())
        if early is None:
            return
        self.current = state
        self.signatures.clear()
        self._open_view()
        if self.round is not None and not state.committee_state:  # fetched while it collects
            self._spawn(self._with_committee_state(state))
        for op, peer, frames in early:
            try:
                await self.handle(op, peer, {}, frames)
            except RpcRefused as e:
                log.info("buffered %s from %s refused: %s", op, peer, e)

    async def _with_committee_state(self, state: CertifiedState) -> CertifiedState:
        """``state`` completed with its committee state (ADR 0064) when it lacks it and this
        node sits on the committee that merges on it, held as ``current`` while it is the
        version installed; one download per version at a time. ``state`` as it is if that
        fails: the merge then fails, and its next attempt asks again."""
        if state.committee_state or self.committee_state is None:
            return state
        pending = self._completing
        if pending is None or pending[0] != state.version or pending[1].done():
            pending = (state.version, asyncio.create_task(self.committee_state(state)))
            self._completing = pending
        try:
            full = await asyncio.shield(pending[1])
        except (SyncError, RpcError) as e:
            log.warning("version %d: no committee state to merge on yet: %s", state.version, e)
            return state
        if self.current is not None and self.current.version == full.version:
            self.current = full
        return full

    def _open_view(self) -> None:
        """Open the round of the node's current view if it sits on that view's committee (the
        node carries what it held in the view before); a view bound to an earlier view's lock
        opens on exactly that input set and fetches what it lacks from the lock's signers."""
        opening = self.node.open_view(self._params, time.monotonic())
        st = opening.seat
        if opening.seating is Seating.WAITING:
            log.error(
                "view %d of version %d is locked on %s, whose inputs this node has not heard: "
                "it waits for them",
                st.view,
                st.version,
                (st.lock or "")[:12],
            )
        if opening.seating is not Seating.MEMBER:
            return
        log.info(
            "on the committee for version %d, view %d (%d members, quorum %d)%s",
            st.version,
            st.view,
            len(st.committee.members),
            st.committee.quorum,
            "" if st.locked is None else f", re-certifying {st.lock[:12] if st.lock else ''}",
        )
        for sub, actions in opening.carried:
            self._execute(list(actions), sub.digest)
        if (fetch := opening.fetch) is not None:
            holders = list(fetch.holders)  # the voters that signed the lock
            self._spawn(self._fetch(fetch.digests, lambda d: holders))

    def _params(
        self, committee: CommitteeInfo, locked: tuple[str, ...] | None, close_after: float
    ) -> RoundParams:
        assert self.current is not None
        active, trusted = learners_awaited(self.manifest, self.current.cert, self.live_learners())
        return round_params(
            self.run_id,
            self.manifest,
            self.current,
            committee,
            active,
            time.monotonic(),
            locked,
            close_after,
            trusted,
            self.intake.max_inputs,
        )

    def _catch_up(self, peer: str) -> None:
        """``peer`` has no open round for this node's message: it may sit in an earlier view."""
        self.views.catch_up(peer)

    def _enter_view(self) -> None:
        """The node moved to a later view of the same version (its votes proved the timeout)."""
        self.signatures.clear()
        self._open_view()

    def tick(self) -> None:
        now = time.monotonic()
        if (intent := self.node.vote_due(now)) is not None:
            body = self.signatures.bodies[intent.signed] if intent.signed is not None else None
            if self.views.vote(intent, body, now):
                self._enter_view()
        if self.round is not None:
            self._execute(self.node.track(self.round.on_tick(now)))

    async def close(self) -> None:
        # A merge's scores and held-out eval under way end at their next batch (MergeStopped)
        for flagged in (self.scorer, self.held_out):
            if flagged is not None:
                flagged.stop()
        completing = [self._completing[1]] if self._completing is not None else []
        await cancel_and_wait([*self._tasks, *completing], "sync service")

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
            return {}, [held.data.raw, held.data.payload]
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
        if self.node.resent(sub.digest) is not None:
            return {"status": "accepted", "version": sub.header.base_version + 1}, []
        refusal = await self._check(sub, rest[0] if rest else None)
        if refusal is not None:
            code, text = refusal
            if code not in RETRYABLE:
                self._reject(sub.envelope.signer, sub.digest, code, text)
            return {"status": "rejected", "code": code.value, "reason": text}, []
        assert self.current is not None and rest
        now, own = time.monotonic(), pass_on and stream_peer == sub.header.peer_id
        verdict, actions = self.node.on_submission(
            self._submission(sub),
            Received(sub, raw, rest[0]),
            now,
            pass_on=own,
            busy=lambda rnd: self.relayer.busy(rnd, now),  # its own learner's: no screen
        )
        if verdict.relay and (rnd := self.round) is not None:
            still = lambda: self.round is rnd and rnd.undecided  # noqa: E731
            self._spawn(self.relayer.relay(self._others(), raw, rest[0], still))
        self._execute(actions, sub.digest)
        if not verdict.accepted:
            assert verdict.code is not None
            return {
                "status": "rejected",
                "code": verdict.code.value,
                "reason": verdict.reason,
                "fast_forward": verdict.fast_forward,
            }, []
        return {
            "status": "accepted",
            "version": self.current.version + 1,
            "clipped": verdict.clipped,
        }, []

    def _submission(self, sub: ParsedSubmission) -> Submission:
        h = sub.header
        return Submission(h.peer_id, self.run_id, h.base_version, h.steps, h.tokens, sub.digest)

    async def _check(self, sub: ParsedSubmission, payload: bytes | None) -> Refusal | None:
        version = self.current.version if self.current is not None else None
        return await self.intake.check(sub, payload, version, self.node.seen)

    def _on_proposal(self, peer: str, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        try:
            prop = open_proposal(frames[0] if frames else b"", self.run_id)
        except BadMessage as e:
            self._reject(e.signer or peer, None, e.code, str(e))
            raise RpcRefused(e.code, str(e)) from None
        if self.node.buffer_if_early(prop.version, ("propose", peer, frames)):
            return {"buffered": True}, []
        refusal, actions, adopted = self.node.on_proposal(
            prop.signer, prop.version, prop.view, prop.digests, prop.attempt, time.monotonic()
        )
        self._execute(actions)
        if refusal is not None:
            raise RpcRefused(*refusal)
        if adopted:
            self._spawn(self.fellows.to_all("propose", frames[0], skip={peer, prop.signer}))
        return {}, []

    def _on_signature(self, peer: str, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        try:
            signer, body, sig = open_signature(frames[0] if frames else b"")
        except BadMessage as e:
            self._reject(peer, None, e.code, str(e))
            raise RpcRefused(e.code, str(e)) from None
        if self.node.buffer_if_early(body.version, ("sign", peer, frames)):
            return {"buffered": True}, []
        if self.round is None or self.current is None or body.version != self.current.version + 1:
            raise RpcRefused(Reason.NO_OPEN_ROUND, f"no open round for version {body.version}")
        p = self.round.params
        if (no := refusal_of(body, self.run_id, p.version, self._view, p.committee)) is not None:
            if no[0] is Reason.WRONG_COMMITTEE:
                self._reject(signer, None, *no)
            raise RpcRefused(*no)
        digest = self.signatures.add(signer, body, sig, len(self.round.params.committee))
        offer = _evaluated(body)
        self._execute(self.node.track(self.round.on_signature(signer, digest, offer)))
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

    # -- actions -----------------------------------------------------------------------------

    def _execute(self, actions: list[Action], context: str | None = None) -> None:
        for a in actions:
            if isinstance(a, Reject):
                self._reject(a.peer_id, context, a.code, a.reason)
            elif isinstance(a, Clipped):
                self._record_clip(a)
            elif isinstance(a, Propose):
                self._spawn(self._propose(a.digests, a.attempt))
            elif isinstance(a, Fetch):
                members = self.committee.members if self.committee else ()
                order = partial(fetch_order, members=members, me=self.me, proposer=a.from_peer)
                self._spawn(self._fetch(a.digests, order))
            elif isinstance(a, Aggregate):
                self._spawn(self._aggregate(a))
            elif isinstance(a, Sign):
                if self.me not in self.signatures.sigs.get(a.state_hash, {}):
                    self.signatures.second(self.identity, a.state_hash)  # the leader's (ADR 0059)
                msg = self.signatures.message(self.me, a.state_hash)  # "later": while uncertified
                live = partial(still_signing, lambda: self.round, self.round)
                self._spawn(self.fellows.to_all("sign", msg, later_while=live))
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
        return self.node.view

    def _others(self) -> list[str]:
        assert self.committee is not None
        return [m for m in self.committee.members if m != self.me]

    async def _propose(self, digests: tuple[str, ...], attempt: int) -> None:
        assert self.current is not None and self.round is not None
        rnd, version = self.round, self.current.version + 1
        view = self._view
        raw = seal_proposal(self.identity, self.run_id, version, attempt, digests, view)
        log.info(
            "proposing %d submissions for version %d (attempt %d)", len(digests), version, attempt
        )
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
                sub = await self.intake.open_fetched(d, frames, version, self.node.seen)
            except (RpcError, InvalidRecord) as e:
                log.warning("could not fetch submission %s: %s", d[:12], e)
                continue
            if rnd is not self.round or rnd is None:
                return
            received = Received(sub, frames[0], frames[1])
            self._execute(self.node.on_fetched(self._submission(sub), received), d)

    async def _aggregate(self, action: Aggregate) -> None:
        rnd, base, committee = self.round, self.current, self.committee
        assert rnd is not None and base is not None and committee is not None
        if not base.committee_state:  # elected by a later view: fetch it now
            base = self.current = await self._with_committee_state(base)
        inputs = [
            (d, held.sub.peer_id, held.data.payload, w, a, held.data.sub.header.data_version)
            for d, w, a in zip(action.digests, action.weights, action.anchors(), strict=True)
            for held in (self.held[d],)
        ]
        loop = asyncio.get_running_loop()
        try:
            result, state = await loop.run_in_executor(None, self._merge, base, inputs)
            eval_loss = await loop.run_in_executor(None, self._evaluate, state)
        except MergeStopped:  # the node is stopping (``close``): nothing more to do
            return
        except Exception as e:  # screened out entirely, or a local fault: next attempt
            log.error("round %d: merge failed (%s); starting the next attempt", base.version + 1, e)
            if rnd is self.round:
                screened = tuple(e.rejected) if isinstance(e, MergeError) else ()
                now = time.monotonic()
                failed = rnd.on_merge_failed(now, attempt=action.attempt, screened_out=screened)
                self._execute(self.node.track(failed))
            return
        if rnd is not self.round:
            return
        headers = {d: self.held[d].data.sub.header for d in action.digests}
        for d, r in sorted(result.rejected.items()):
            self._reject(headers[d].peer_id, d, Reason.SCREENED_OUT, f"screened out: {r}")
        view = self._view
        body = certificate_body(
            self.run_id,
            self.manifest,
            base,
            committee,
            state.state_hash,
            headers,
            result.accepted,
            result.rejected,
            view=view,
            update_hash=state.update_hash,
            eval_loss=eval_loss,
            params_hash=certified_params_hash(state, self.rules),
            uncredited=result.uncredited,
        )
        lock = self.node.views.lock if self.node.views is not None else None
        if lock is not None and content_digest(body) != lock:
            log.error(
                "version %d: merge differs from the locked content %s; not signing",
                body.version,
                lock[:12],
            )
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
        evaluated = _evaluated(body)
        self._execute(self.node.track(rnd.on_aggregated(digest, action.attempt, evaluated)))

    def _merge(
        self, base: CertifiedState, inputs: list[tuple[str, str, bytes, float, bool, int | None]]
    ) -> tuple[MergeResult, CertifiedState]:
        decode = self.intake.decode
        merge_inputs = [
            MergeInput(d, p, decode(b, base.version), w, a, rows) for d, p, b, w, a, rows in inputs
        ]
        return next_state(base, merge_inputs, self.rules, self.outer, self._work(base))

    def _work(self, base: CertifiedState) -> WorkCheck | None:
        """The work check of the round on ``base`` (ADR 0062), None when the run scores none.
        Raises RuntimeError for a run that scores work on a syncer without a scorer."""
        if self.rules.work is None:
            return None
        if self.scorer is None:
            raise RuntimeError("this run scores work, and this syncer has no corpus to score on")
        last = None
        if base.update is not None:
            shapes = {n: tuple(t.shape) for n, t in base.params.items()}
            try:
                last = decode_update(base.update, rules_codec(self.rules), shapes)
            except UpdateError:  # a fragment's update: that screen is skipped
                last = None
        score = self.scorer.bind(base.params, base.version)
        earned = trusted_peers(self.manifest, base.cert) is not None
        founders = frozenset(e.peer_id for e in genesis_roster(self.manifest))
        return WorkCheck(
            self.rules.work, score, last, base.version, trust_earned=earned, founders=founders
        )

    def _evaluate(self, state: CertifiedState) -> float | None:
        """The merge's eval step: the merged state's loss on the run's held-out batches (ADR
        0059); None when the run evaluates nothing."""
        if self.held_out is None:
            return None
        return self.held_out.loss(state.params)

    def _finish(self, done: Done) -> None:
        tcs = tuple(self.node.views.tcs) if self.node.views is not None else ()
        raw, cert, state = self.signatures.certificate(
            done.state_hash, done.signers, tcs, self.run_id
        )
        if state is not None:  # merged here, so the roster is the one this member derived
            assert self.current is not None
            state.cert = cert = with_roster(self.manifest, self.current.cert, cert)
        late = "" if done.agreed_with_quorum else " (this syncer's merge differed, failed or late)"
        log.info(
            "version %d certified by %d/%d syncers (view %d)%s",
            cert.body.version,
            len(done.signers),
            len(cert.body.committee),
            cert.body.view,
            late,
        )
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
            {
                "peer_id": peer,
                "digest": digest,
                "code": code.value,
                "reason": reason[:300],
                "round": version,
            }
        )


def _evaluated(body: CertificateBody) -> Evaluated | None:
    """What a body says of its eval (ADR 0059): its content and loss; None without a loss."""
    if body.eval_loss is None:
        return None
    return Evaluated(content_digest(body), body.eval_loss)
