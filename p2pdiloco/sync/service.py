"""The asyncio driver of one node's syncer duty: the sans-IO ``SyncerRound`` on the runtime loop.

When the node sits on the committee of the next version, this feeds the round with what
arrives (submissions, the leader's proposal, fellow syncers' signatures, clock ticks) and
carries out the actions it returns: reject (logged with the peer id and a ``Reason`` code),
propose, fetch, merge (``sync.aggregator.merge_round`` in a worker thread), sign, assemble the
certificate. Every rule that changes certified bytes comes from the signed manifest
(``manifest.rules``); nothing local does. A merge that fails starts the round's next attempt
instead of leaving it stuck. Every per-peer and per-submission structure is bounded.

All methods run on the runtime's loop; nothing here is called from another thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from p2pdiloco.net.sync_rpc import RpcError, RpcRefused
from p2pdiloco.protocol.certificates import CertificateBody, assemble, body_digest, sign_body
from p2pdiloco.protocol.certificates import parse_certificate as _parse_cert
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import RETRYABLE, Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.protocol.submissions import ParsedSubmission, open_submission
from p2pdiloco.runtime.transport import Transport
from p2pdiloco.sync.aggregator import MergeError, MergeInput, MergeResult, merge_round
from p2pdiloco.sync.bounded import BoundedLog, ReplayGuard
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.sync.committee_msgs import (
    MAX_PROPOSAL_BYTES,
    BadMessage,
    certificate_body,
    open_proposal,
    open_signature,
    seal_proposal,
    signature_message,
)
from p2pdiloco.sync.intake import Intake, Refusal
from p2pdiloco.sync.roster import CommitteeInfo, committee_for, roster_of
from p2pdiloco.sync.round import (
    Action,
    Aggregate,
    Clipped,
    Done,
    Dropped,
    FastForward,
    Fetch,
    Propose,
    Reject,
    RoundParams,
    Sign,
    Standing,
    Submission,
    SyncerRound,
)
from p2pdiloco.train.outer import OuterConfig

log = logging.getLogger(__name__)

MAX_SIGNATURE_BYTES = 1 << 20
MAX_BUFFERED = 256  # early proposals/signatures kept for a round this syncer has not opened
MAX_REJECTIONS_KEPT = 1000
MAX_FAST_FORWARD_KEPT = 4096


@dataclass
class _Held:
    """An accepted submission, kept until the round that merges it is over."""

    sub: ParsedSubmission
    raw: bytes
    payload: bytes
    fetched: bool = False  # came from a fellow syncer, not (yet) from the learner itself


def request_limits(max_payload: int) -> dict[str, tuple[int, ...]]:
    """Per-op request frame limits of the sync protocol (docs/protocol.md, Sync transport)."""
    return {
        "submit": (16 * 1024, max_payload),
        "propose": (MAX_PROPOSAL_BYTES,),
        "sign": (MAX_SIGNATURE_BYTES,),
        "fetch": (),
        "receipt": (),
        "cert": (),
        "index": (),
        "chunk": (),
    }


class SyncService:
    def __init__(
        self,
        identity: Identity,
        run_id: str,
        manifest: RunManifest,
        shapes: Mapping[str, tuple[int, ...]],
        transport: Transport,
        *,
        active_learners: Callable[[], int],
        on_certified: Callable[[bytes, CertifiedState | None], None],
    ) -> None:
        self.identity = identity
        self.me = identity.peer_id
        self.run_id = run_id
        self.manifest = manifest
        self.rules = manifest.rules
        self.intake = Intake(manifest, shapes, run_id, self._reject)
        self.max_payload = self.intake.max_payload
        self.screen = self.intake.screen  # a submission's header, before its payload is read
        self.transport = transport
        self.active_learners = active_learners
        self.on_certified = on_certified
        self.outer = OuterConfig(
            lr=manifest.outer.lr, momentum=manifest.outer.momentum, nesterov=manifest.outer.nesterov
        )
        self.current: CertifiedState | None = None
        self.committee: CommitteeInfo | None = None
        self.round: SyncerRound | None = None
        self.held: dict[str, _Held] = {}  # bounded by the round's max_inputs
        self.seen = ReplayGuard.for_staleness(self.rules.staleness)
        self.fast_forward: dict[str, int] = {}
        self.bodies: dict[str, CertificateBody] = {}  # by state hash, this round only
        self.sigs: dict[str, dict[str, str]] = {}  # state hash → signer → signature
        self.results: dict[str, CertifiedState] = {}
        self.buffered: list[tuple[int, str, str, list[bytes]]] = []
        self.rejections: BoundedLog[dict[str, Any]] = BoundedLog(MAX_REJECTIONS_KEPT)
        self.clipped = 0  # submissions counted with a clipped claim (plausible_claim)
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle -------------------------------------------------------------------------------

    async def install(self, state: CertifiedState) -> None:
        """A newly certified (or genesis, or downloaded) version: open the next round if this
        node is on its committee."""
        if self.current is not None and state.version <= self.current.version:
            return
        self.current = state
        self.seen.advance(state.version)
        self.held.clear()
        self.bodies.clear()
        self.sigs.clear()
        self.results.clear()
        self.fast_forward.clear()
        self.committee = committee_for(self.run_id, self.manifest, state.cert)
        self.round = None
        if self.me in self.committee.members:
            self.round = SyncerRound(self._round_params(state, self.committee), self.me)
            log.info(
                "on the committee for version %d (%d members, quorum %d)",
                state.version + 1,
                len(self.committee.members),
                self.committee.quorum,
            )
        early = [b for b in self.buffered if b[0] == state.version + 1]
        self.buffered = [b for b in self.buffered if b[0] > state.version + 1]
        for _, op, peer, frames in early:
            try:
                await self.handle(op, peer, {}, frames)
            except RpcRefused as e:
                log.info("buffered %s from %s refused: %s", op, peer, e)

    def _round_params(self, state: CertifiedState, committee: CommitteeInfo) -> RoundParams:
        r, inner = self.rules, self.manifest.inner
        return RoundParams(
            run_id=self.run_id,
            version=state.version,
            committee=committee.members,
            quorum=committee.quorum,
            # Live heartbeats lag at start-up; the roster (peers merged recently) does not.
            active_learners=max(
                1, self.active_learners(), len(roster_of(self.manifest, state.cert))
            ),
            opened_at=time.monotonic(),
            grace=r.grace,
            min_fraction=r.min_quorum_fraction,
            staleness=r.staleness,
            max_tokens_per_step=inner.batch_size * inner.seq_len,
            max_steps=self.manifest.inner_steps,
            weight_cap=r.weight_cap,
            agree_timeout=r.agree_timeout,
            linger=r.linger,
        )

    def tick(self) -> None:
        if self.round is not None:
            self._execute(self.round.on_tick(time.monotonic()))

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- requests --------------------------------------------------------------------------------

    async def handle(
        self, op: str, peer: str, control: dict[str, Any], frames: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        if op == "submit":
            return await self._on_submit(peer, frames[0] if frames else b"", frames[1:])
        if op == "propose":
            return self._on_proposal(peer, frames)
        if op == "sign":
            return self._on_signature(peer, frames)
        if op == "fetch":
            held = self.held.get(str(control.get("digest")))
            if held is None:
                raise RpcRefused(Reason.NOT_FOUND, "no such submission here")
            return {}, [held.raw, held.payload]
        if op == "receipt":
            return self._on_receipt(str(control.get("digest", ""))), []
        raise RpcRefused(Reason.UNKNOWN_OP, f"unknown op {op[:32]!r}")

    def _on_receipt(self, digest: str) -> dict[str, Any]:
        """Where a learner's submission stands in this syncer's round."""
        if self.round is None:
            return {"status": "unknown"}
        status = self.round.status_of(digest)
        if status.standing is Standing.DROPPED and status.code is not None:
            return {"status": "dropped", "code": status.code.value}
        return {"status": status.standing.value}

    async def _on_submit(
        self, stream_peer: str, raw: bytes, rest: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        try:
            sub = open_submission(raw, run_id=self.run_id)
        except InvalidRecord as e:
            self._reject(e.signer or stream_peer, None, Reason.INVALID_SIGNATURE, str(e))
            raise RpcRefused(Reason.INVALID_SIGNATURE, f"invalid submission: {e}") from None
        held = self.held.get(sub.digest)
        if held is not None and held.fetched:  # the learner's own copy, late: not a replay
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
        self.seen.add(sub.digest, h.base_version)
        if self.round is None:
            text = f"not on the committee for version {self.current.version + 1}"
            ff = self.current.version if h.base_version < self.current.version else None
            return {"status": "rejected", "code": Reason.NOT_ON_COMMITTEE.value, "reason": text,
                    "fast_forward": ff}, []  # fmt: skip
        rnd = self.round
        actions = rnd.on_submission(self._submission(sub), time.monotonic())
        rejected = [a for a in actions if isinstance(a, Reject) and a.peer_id == h.peer_id]
        if not rejected:
            self.held[sub.digest] = _Held(sub, raw, rest[0])
        self._execute(actions, sub.digest)
        if rejected:
            return {
                "status": "rejected",
                "code": rejected[0].code.value,
                "reason": rejected[0].reason,
                "fast_forward": self.fast_forward.pop(h.peer_id, None),
            }, []
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
        if self.round is None or self.current is None or prop.version != self.current.version + 1:
            raise RpcRefused(Reason.NO_OPEN_ROUND, f"no open round for version {prop.version}")
        actions = self.round.on_proposal(
            prop.signer, prop.digests, time.monotonic(), attempt=prop.attempt
        )
        refused = [a for a in actions if isinstance(a, Reject) and a.peer_id == prop.signer]
        self._execute(actions)
        if refused:
            raise RpcRefused(refused[0].code, refused[0].reason)
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
        if body.run != self.run_id or body.base_version != self.current.version:
            raise RpcRefused(Reason.WRONG_RUN, "signature for another run or base version")
        if tuple(body.committee) != self.round.params.committee:
            self._reject(
                signer, None, Reason.WRONG_COMMITTEE, "signed a body naming another committee"
            )
            raise RpcRefused(Reason.WRONG_COMMITTEE, "wrong committee")
        digest = body_digest(body)
        if digest not in self.bodies and len(self.bodies) >= 2 * len(self.round.params.committee):
            raise RpcRefused(Reason.BUSY, "too many distinct bodies this round")
        self.bodies.setdefault(digest, body)
        self.sigs.setdefault(digest, {})[signer] = sig
        self._execute(self.round.on_signature(signer, digest))
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
                self._spawn(self._fetch(a.digests, a.from_peer))
            elif isinstance(a, Aggregate):
                self._spawn(self._aggregate(a))
            elif isinstance(a, Sign):
                self._spawn(self._send_signature(a.state_hash))
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

    def _others(self) -> list[str]:
        assert self.committee is not None
        return [m for m in self.committee.members if m != self.me]

    async def _send(self, peer: str, op: str, frame: bytes, attempts: int = 4) -> None:
        for attempt in range(attempts):
            try:
                await self.transport.call(peer, op, frames=[frame])
                return
            except RpcError as e:
                log.info("%s to %s failed (attempt %d): %s", op, peer, attempt + 1, e)
                if e.refused and e.code not in RETRYABLE:
                    return
                await asyncio.sleep(1.0 + attempt)

    async def _propose(self, digests: tuple[str, ...], attempt: int) -> None:
        assert self.current is not None
        version = self.current.version + 1
        raw = seal_proposal(self.identity, self.run_id, version, attempt, digests)
        log.info("proposing %d submissions for version %d (attempt %d)", len(digests), version,
                 attempt)  # fmt: skip
        await asyncio.gather(*(self._send(p, "propose", raw) for p in self._others()))

    async def _fetch(self, digests: tuple[str, ...], from_peer: str) -> None:
        rnd = self.round
        for d in digests:
            try:
                _, frames = await self.transport.call(
                    from_peer, "fetch", args={"digest": d}, reply_limit=self.max_payload
                )
                sub = open_submission(frames[0], run_id=self.run_id)
                if sub.digest != d:
                    raise InvalidRecord("fetched submission has another digest", signer=from_peer)
                refusal = await self._check(sub, frames[1] if len(frames) > 1 else None)
                if refusal is not None and refusal[0] is not Reason.REPLAYED:
                    raise InvalidRecord(refusal[1], signer=sub.envelope.signer)
            except (RpcError, InvalidRecord, IndexError) as e:
                log.warning("could not fetch submission %s from %s: %s", d[:12], from_peer, e)
                continue
            if rnd is not self.round or rnd is None:
                return
            self.seen.add(d, sub.header.base_version)
            self.held[d] = _Held(sub, frames[0], frames[1], fetched=True)
            self._execute(rnd.on_fetched(self._submission(sub)), d)

    async def _aggregate(self, action: Aggregate) -> None:
        rnd, base, committee = self.round, self.current, self.committee
        assert rnd is not None and base is not None and committee is not None
        inputs = [
            (d, self.held[d].sub.header.peer_id, self.held[d].payload, w)
            for d, w in zip(action.digests, action.weights, strict=True)
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
        body = certificate_body(
            self.run_id, self.manifest, base, committee, state.state_hash, headers,
            result.accepted, result.rejected,
        )  # fmt: skip
        digest = body_digest(body)
        self.bodies[digest] = body
        self.results[digest] = state
        self.sigs.setdefault(digest, {})[self.me] = sign_body(self.identity, body)
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
        self, base: CertifiedState, inputs: list[tuple[str, str, bytes, float]]
    ) -> tuple[MergeResult, CertifiedState]:
        merge_inputs = [
            MergeInput(digest=d, peer_id=p, delta=self.intake.decode(payload), weight=w)
            for d, p, payload, w in inputs
        ]
        result = merge_round(
            base.params, base.momentum, merge_inputs, rules=self.rules, outer=self.outer
        )
        state = CertifiedState(base.version + 1, None, result.params, result.momentum)
        state.blob()
        return result, state

    async def _send_signature(self, digest: str) -> None:
        msg = signature_message(self.me, self.bodies[digest], self.sigs[digest][self.me])
        await asyncio.gather(*(self._send(p, "sign", msg) for p in self._others()))

    def _finish(self, done: Done) -> None:
        body = self.bodies[done.state_hash]
        raw = assemble(body, {s: self.sigs[done.state_hash][s] for s in done.signers})
        cert = _parse_cert(raw, run_id=self.run_id)
        state = self.results.get(done.state_hash)
        if state is not None:
            state.cert = cert
        log.info(
            "version %d certified by %d/%d syncers%s",
            body.version,
            len(done.signers),
            len(body.committee),
            ""
            if done.agreed_with_quorum
            else " (this syncer's merge differed, failed or was late)",
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
            {"peer_id": peer, "digest": digest, "code": code.value, "reason": reason[:300],
             "round": version}
        )  # fmt: skip
