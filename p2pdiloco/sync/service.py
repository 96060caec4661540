"""The asyncio driver of the sync protocol: one node's syncer duty and its public state service.

Runs on the node's P2P loop (``net.p2p_bridge``). It answers every node's requests for
certificates and state chunks, and, when the node sits on the committee of the next version, it
feeds the sans-IO ``SyncerRound`` with what arrives (submissions, the leader's proposal, fellow
syncers' signatures, clock ticks) and carries out the actions it returns: reject (logged with
the peer id), propose, fetch, aggregate (``sync.aggregator`` in a worker thread), sign, and
assemble the certificate. Nothing here blocks the loop for long: decoding and merging run in the
executor, and every peer input is size-checked, verified and bounded before it is kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import P2P

from p2pdiloco.compress import CodecError, get_codec
from p2pdiloco.compress.wire import unpack_deltas
from p2pdiloco.net import sync_rpc
from p2pdiloco.net.sync_rpc import RpcError, RpcRefused
from p2pdiloco.protocol.certificates import (
    Accepted,
    CertificateBody,
    Rejected,
    assemble,
    body_digest,
    parse_certificate,
    sign_body,
    verify_body_signature,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord, canonical_json, open_envelope, seal
from p2pdiloco.protocol.submissions import ParsedSubmission, open_submission, payload_digest
from p2pdiloco.sync.aggregator import MergeInput, merge_round
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.sync.roster import CommitteeInfo, committee_for, next_roster, roster_of
from p2pdiloco.sync.round import (
    Action,
    Aggregate,
    Done,
    FastForward,
    Fetch,
    Propose,
    Reject,
    RoundParams,
    Sign,
    Submission,
    SyncerRound,
)
from p2pdiloco.train.outer import OuterConfig

log = logging.getLogger(__name__)

PROPOSAL_KIND = "proposal"
MAX_SIGNATURE_BYTES = 1 << 20
MAX_BUFFERED = 256  # early proposals/signatures kept for a round this syncer has not opened
MAX_REJECTIONS_KEPT = 1000


@dataclass
class SyncSettings:
    """Local policy of a syncer (the consensus rules themselves come from the manifest)."""

    rule: str = "trimmed_mean"
    rule_params: dict[str, float] = field(default_factory=dict)
    screen_norm_factor: float | None = 3.0
    grace: float = 60.0  # seconds a round collects before closing with what it has
    agree_timeout: float = 20.0  # seconds before the next committee member takes over as leader
    linger: float = 3.0  # seconds a round waits for stragglers once the learner quorum is in
    tick: float = 0.5


@dataclass
class _Held:
    """An accepted submission, kept until the round that merges it is over."""

    sub: ParsedSubmission
    raw: bytes
    payload: bytes


class SyncService:
    """Owns the syncer round of the next version; thread-safe entry points are marked."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        manifest: RunManifest,
        shapes: Mapping[str, tuple[int, ...]],
        settings: SyncSettings,
        *,
        addrs_of: Callable[[str], list[str]],
        active_learners: Callable[[], int],
        on_certified: Callable[[bytes, CertifiedState | None], None],
    ) -> None:
        self.identity = identity
        self.me = identity.peer_id
        self.run_id = run_id
        self.manifest = manifest
        self.shapes = dict(sorted(shapes.items()))
        self.settings = settings
        self.addrs_of = addrs_of
        self.active_learners = active_learners
        self.on_certified = on_certified
        self.codec = get_codec(manifest.compression)
        numel = sum(max(1, math.prod(s)) for s in self.shapes.values())
        self.max_payload = numel * 4 + 4096 * len(self.shapes) + (1 << 20)
        self.outer = OuterConfig(
            lr=manifest.outer.lr, momentum=manifest.outer.momentum, nesterov=manifest.outer.nesterov
        )
        self.p2p: P2P | None = None
        self.current: CertifiedState | None = None
        self.previous: CertifiedState | None = None
        self.certs: dict[int, bytes] = {}  # version → certificate bytes this node holds
        self.committee: CommitteeInfo | None = None
        self.round: SyncerRound | None = None
        self.held: dict[str, _Held] = {}
        self.seen: set[str] = set()  # submission digests ever received (replay guard)
        self.fast_forward: dict[str, int] = {}
        self.bodies: dict[str, CertificateBody] = {}
        self.sigs: dict[str, dict[str, str]] = defaultdict(dict)
        self.results: dict[str, CertifiedState] = {}
        self.buffered: list[tuple[int, str, str, list[bytes]]] = []
        self.rejections: list[dict[str, Any]] = []  # what this syncer rejected, newest last
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[Any] | None = None

    # -- lifecycle (on the loop) -------------------------------------------------------------

    async def start(self, p2p: P2P) -> None:
        self.p2p = p2p
        limits = {
            "submit": (16 * 1024, self.max_payload),
            "propose": (64 * 1024,),
            "sign": (MAX_SIGNATURE_BYTES,),
            "fetch": (),
            "cert": (),
            "index": (),
            "chunk": (),
        }
        await sync_rpc.serve(p2p, self.handle, limits)
        self._ticker = asyncio.create_task(self._tick_loop())

    async def install(self, state: CertifiedState) -> None:
        """A newly certified (or genesis, or downloaded) version: open the next round if this
        node is on its committee, and serve the state to peers."""
        if self.current is not None and state.version <= self.current.version:
            return
        await asyncio.get_running_loop().run_in_executor(None, state.blob)  # hash off the loop
        if state.cert is not None:
            self.certs[state.version] = state.cert.raw
        self.previous, self.current = self.current, state
        self.held.clear()
        self.bodies.clear()
        self.sigs.clear()
        self.results.clear()
        self.committee = committee_for(self.run_id, self.manifest, state.cert)
        self.round = None
        if self.me in self.committee.members:
            self.round = SyncerRound(
                RoundParams(
                    run_id=self.run_id,
                    version=state.version,
                    committee=self.committee.members,
                    quorum=self.committee.quorum,
                    # Live heartbeats lag at start-up; the roster (peers merged recently) does not.
                    active_learners=max(
                        1, self.active_learners(), len(roster_of(self.manifest, state.cert))
                    ),
                    opened_at=time.monotonic(),
                    grace=self.settings.grace,
                    min_fraction=self.manifest.min_quorum_fraction,
                    staleness=self.manifest.staleness,
                    max_tokens_per_step=self.manifest.inner.batch_size
                    * self.manifest.inner.seq_len,
                    agree_timeout=self.settings.agree_timeout,
                    linger=self.settings.linger,
                ),
                self.me,
            )
            log.info(
                "on the committee for version %d (%d members, quorum %d)",
                state.version + 1,
                len(self.committee.members),
                self.committee.quorum,
            )
        for item in [b for b in self.buffered if b[0] == state.version + 1]:
            self.buffered.remove(item)
            await self.handle(item[1], item[2], {}, item[3])
        self.buffered = [b for b in self.buffered if b[0] > state.version + 1]

    def add_cert(self, version: int, raw: bytes) -> None:
        self.certs[version] = raw

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for t in list(self._tasks):
            t.cancel()

    # -- requests ----------------------------------------------------------------------------

    async def handle(
        self, op: str, peer: str, control: dict[str, Any], frames: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        if op == "submit":
            return await self._on_submit(peer, frames[0] if frames else b"", frames[1:])
        if op == "propose":
            return await self._on_proposal(peer, frames)
        if op == "sign":
            return await self._on_signature(peer, frames)
        if op == "fetch":
            held = self.held.get(str(control.get("digest")))
            if held is None:
                raise RpcRefused("no such submission here")
            return {}, [held.raw, held.payload]
        if op == "cert":
            version = control.get("version")
            if version == -1 and self.certs:
                version = max(self.certs)
            raw = self.certs.get(version) if isinstance(version, int) else None
            if raw is None:
                raise RpcRefused(f"no certificate for version {version!r} here")
            return {"version": version}, [raw]
        if op in ("index", "chunk"):
            return self._on_state_request(op, control)
        raise RpcRefused(f"unknown op {op}")

    def _on_state_request(
        self, op: str, control: dict[str, Any]
    ) -> tuple[dict[str, Any], list[bytes]]:
        version = control.get("version")
        held = [s for s in (self.current, self.previous) if s is not None and s.version == version]
        if not held:
            raise RpcRefused(f"state of version {version!r} is not held here")
        blob = held[0].blob()
        if op == "index":
            return {"state_hash": blob.state_hash}, [blob.index_bytes]
        i = control.get("i")
        if not isinstance(i, int) or not 0 <= i < len(blob.chunks):
            raise RpcRefused("chunk index out of range")
        return {}, [bytes(blob.chunks[i])]

    async def _on_submit(
        self, stream_peer: str, raw: bytes, rest: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        try:
            sub = open_submission(raw, run_id=self.run_id)
        except InvalidRecord as e:
            self._reject(e.signer or stream_peer, None, f"invalid submission: {e}")
            raise RpcRefused(f"invalid submission: {e}") from None
        reason = await self._check_submission(sub, rest[0] if rest else None)
        if reason is not None:
            self._reject(sub.envelope.signer, sub.digest, reason)
            return {"status": "rejected", "reason": reason}, []
        assert self.current is not None and rest
        h = sub.header
        if h.base_version > self.current.version:  # not seen yet: the learner will re-send
            return {
                "status": "retry",
                "reason": f"this syncer holds version {self.current.version}",
            }, []
        self.seen.add(sub.digest)
        if self.round is None:
            reason = f"not on the committee for version {self.current.version + 1}"
            ff = self.current.version if h.base_version < self.current.version else None
            return {"status": "rejected", "reason": reason, "fast_forward": ff}, []
        rnd = self.round
        actions = rnd.on_submission(
            Submission(
                peer_id=h.peer_id,
                run_id=self.run_id,
                base_version=h.base_version,
                steps=h.steps,
                tokens=h.tokens,
                digest=sub.digest,
            ),
            time.monotonic(),
        )
        rejected = [a for a in actions if isinstance(a, Reject) and a.peer_id == h.peer_id]
        if not rejected:
            self.held[sub.digest] = _Held(sub, raw, rest[0])
        await self._execute(actions, sub.digest)
        if rejected:
            return {
                "status": "rejected",
                "reason": rejected[0].reason,
                "fast_forward": self.fast_forward.pop(h.peer_id, None),
            }, []
        return {"status": "accepted", "version": self.current.version + 1}, []

    async def _check_submission(self, sub: ParsedSubmission, payload: bytes | None) -> str | None:
        """Everything about a submission that does not depend on the round; None if fine."""
        h = sub.header
        if payload is None:
            return "submission without a payload"
        if sub.digest in self.seen:
            return "replayed submission (this exact signed submission was already received)"
        if self.current is None:
            return "this node has no certified state yet"
        if h.codec != self.manifest.compression:
            return f"codec {h.codec} is not the run's {self.manifest.compression}"
        if len(h.fragments) != 1 or h.fragments[0].index != 0:
            return "expected exactly one fragment (index 0)"
        frag = h.fragments[0]
        if frag.nbytes != len(payload) or frag.digest != payload_digest(payload):
            return "payload does not match the digest in the signed header"
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self._decode, payload)
        except CodecError as e:
            return f"malformed payload: {e}"
        return None

    def _decode(self, payload: bytes) -> dict[str, torch.Tensor]:
        enc = unpack_deltas(
            payload,
            expected=self.shapes,
            codec=self.manifest.compression,
            max_bytes=self.max_payload,
        )
        return {n: self.codec.decode(e) for n, e in enc.items()}

    async def _on_proposal(
        self, peer: str, frames: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        try:
            env = open_envelope(
                frames[0] if frames else b"", kind=PROPOSAL_KIND, run_id=self.run_id
            )
            version, digests = env.body.get("version"), env.body.get("digests")
            if not isinstance(version, int) or not isinstance(digests, list):
                raise InvalidRecord("proposal body needs version and digests", signer=env.signer)
            if len(digests) > 4096 or not all(isinstance(d, str) and len(d) == 64 for d in digests):
                raise InvalidRecord("proposal digests malformed", signer=env.signer)
        except InvalidRecord as e:
            self._reject(e.signer or peer, None, f"invalid proposal: {e}")
            raise RpcRefused(f"invalid proposal: {e}") from None
        if self._buffer_if_early(version, "propose", peer, frames):
            return {"buffered": True}, []
        if self.round is None or self.current is None or version != self.current.version + 1:
            raise RpcRefused(f"no open round for version {version}")
        await self._execute(self.round.on_proposal(env.signer, tuple(digests), time.monotonic()))
        return {}, []

    async def _on_signature(
        self, peer: str, frames: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        try:
            msg = json.loads(frames[0].decode()) if frames else None
            if not isinstance(msg, dict) or set(msg) != {"signer", "body", "sig"}:
                raise ValueError("signature message needs signer, body and sig")
            body = CertificateBody.model_validate(msg["body"])
            signer, sig = msg["signer"], msg["sig"]
            if not isinstance(signer, str) or not verify_body_signature(signer, body, sig):
                raise ValueError("certificate signature does not verify")
        except Exception as e:
            self._reject(peer, None, f"invalid signature message: {str(e)[:200]}")
            raise RpcRefused(f"invalid signature message: {str(e)[:200]}") from None
        if self._buffer_if_early(body.version, "sign", peer, frames):
            return {"buffered": True}, []
        if self.round is None or self.current is None or body.version != self.current.version + 1:
            raise RpcRefused(f"no open round for version {body.version}")
        if body.run != self.run_id or body.base_version != self.current.version:
            raise RpcRefused("signature for another run or base version")
        if tuple(body.committee) != self.round.params.committee:
            self._reject(signer, None, "signed a certificate naming the wrong committee")
            raise RpcRefused("wrong committee")
        digest = body_digest(body)
        self.bodies.setdefault(digest, body)
        self.sigs[digest][signer] = sig
        await self._execute(self.round.on_signature(signer, digest))
        return {}, []

    def _buffer_if_early(self, version: int, op: str, peer: str, frames: list[bytes]) -> bool:
        current = self.current.version if self.current is not None else -1
        if current + 1 < version <= current + 3 and len(self.buffered) < MAX_BUFFERED:
            self.buffered.append((version, op, peer, frames))
            return True
        return False

    # -- actions -----------------------------------------------------------------------------

    async def _execute(self, actions: list[Action], context: str | None = None) -> None:
        for a in actions:
            if isinstance(a, Reject):
                self._reject(a.peer_id, context, a.reason)
            elif isinstance(a, FastForward):
                self.fast_forward[a.peer_id] = a.to_version
            elif isinstance(a, Propose):
                self._spawn(self._propose(a.digests))
            elif isinstance(a, Fetch):
                self._spawn(self._fetch(a.digests, a.from_peer))
            elif isinstance(a, Aggregate):
                self._spawn(self._aggregate(a))
            elif isinstance(a, Sign):
                self._spawn(self._send_signature(a.state_hash))
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
        assert self.p2p is not None
        for attempt in range(attempts):
            try:
                await sync_rpc.call(self.p2p, peer, op, frames=[frame], addrs=self.addrs_of(peer))
                return
            except RpcError as e:
                log.info("%s to %s failed (attempt %d): %s", op, peer, attempt + 1, e)
                if e.refused and "no open round" not in str(e):
                    return
                await asyncio.sleep(1.0 + attempt)

    async def _propose(self, digests: tuple[str, ...]) -> None:
        assert self.current is not None
        version = self.current.version + 1
        raw = seal(
            self.identity,
            PROPOSAL_KIND,
            self.run_id,
            {"version": version, "digests": list(digests)},
        )
        log.info("proposing %d submissions for version %d", len(digests), version)
        await asyncio.gather(*(self._send(p, "propose", raw) for p in self._others()))

    async def _fetch(self, digests: tuple[str, ...], from_peer: str) -> None:
        assert self.p2p is not None
        rnd = self.round
        for d in digests:
            try:
                _, frames = await sync_rpc.call(
                    self.p2p,
                    from_peer,
                    "fetch",
                    args={"digest": d},
                    reply_limit=self.max_payload,
                    addrs=self.addrs_of(from_peer),
                )
                sub = open_submission(frames[0], run_id=self.run_id)
                if sub.digest != d:
                    raise InvalidRecord("fetched submission has another digest", signer=from_peer)
                reason = await self._check_submission(sub, frames[1] if len(frames) > 1 else None)
                if reason is not None and not reason.startswith("replayed"):
                    raise InvalidRecord(reason, signer=sub.envelope.signer)
            except (RpcError, InvalidRecord, IndexError) as e:
                log.warning("could not fetch submission %s from %s: %s", d[:12], from_peer, e)
                continue
            if rnd is not self.round or rnd is None:
                return
            self.seen.add(d)
            self.held[d] = _Held(sub, frames[0], frames[1])
            h = sub.header
            await self._execute(
                rnd.on_fetched(
                    Submission(h.peer_id, self.run_id, h.base_version, h.steps, h.tokens, d)
                ),
                d,
            )

    async def _aggregate(self, action: Aggregate) -> None:
        rnd, base = self.round, self.current
        assert rnd is not None and base is not None and self.committee is not None
        inputs = []
        for d, w in zip(action.digests, action.weights, strict=True):
            held = self.held[d]
            inputs.append((d, held.sub.header.peer_id, held.payload, w))
        loop = asyncio.get_running_loop()
        try:
            result, state = await loop.run_in_executor(None, self._merge, base, inputs)
        except ValueError as e:
            log.error("round %d: no merge possible: %s", base.version + 1, e)
            return
        if rnd is not self.round:
            return
        headers = {d: self.held[d].sub.header for d in action.digests}
        accepted = [
            Accepted(
                peer_id=headers[d].peer_id,
                digest=d,
                steps=headers[d].steps,
                tokens=headers[d].tokens,
            )
            for d in sorted(result.accepted)
        ]
        rejected = [
            Rejected(peer_id=headers[d].peer_id, digest=d, reason=r[:200])
            for d, r in sorted(result.rejected.items())
        ]
        for r in rejected:
            self._reject(r.peer_id, r.digest, f"screened out at aggregation: {r.reason}")
        body = CertificateBody(
            run=self.run_id,
            version=base.version + 1,
            base_version=base.version,
            state_hash=state.state_hash,
            committee=list(self.committee.members),
            quorum=self.committee.quorum,
            accepted=accepted,
            rejected=rejected,
            roster=next_roster(
                roster_of(self.manifest, base.cert), new_version=base.version + 1, accepted=accepted
            ),
        )
        digest = body_digest(body)
        self.bodies[digest] = body
        self.results[digest] = state
        self.sigs[digest][self.me] = sign_body(self.identity, body)
        log.info(
            "merged version %d: %d accepted, %d screened out (%s), state %s",
            body.version,
            len(accepted),
            len(rejected),
            result.rule,
            state.state_hash[:12],
        )
        await self._execute(rnd.on_aggregated(digest))

    def _merge(
        self, base: CertifiedState, inputs: list[tuple[str, str, bytes, float]]
    ) -> tuple[Any, CertifiedState]:
        merge_inputs = [
            MergeInput(digest=d, peer_id=p, delta=self._decode(payload), weight=w)
            for d, p, payload, w in inputs
        ]
        result = merge_round(
            base.params,
            base.momentum,
            merge_inputs,
            rule=self.settings.rule,
            rule_params=self.settings.rule_params,
            outer=self.outer,
            screen_norm_factor=self.settings.screen_norm_factor,
        )
        state = CertifiedState(base.version + 1, None, result.params, result.momentum)
        state.blob()
        return result, state

    async def _send_signature(self, digest: str) -> None:
        body = self.bodies[digest]
        msg = canonical_json(
            {
                "signer": self.me,
                "body": body.model_dump(mode="json"),
                "sig": self.sigs[digest][self.me],
            }
        )
        await asyncio.gather(*(self._send(p, "sign", msg) for p in self._others()))

    def _finish(self, done: Done) -> None:
        body = self.bodies[done.state_hash]
        raw = assemble(body, {s: self.sigs[done.state_hash][s] for s in done.signers})
        cert = parse_certificate(raw, run_id=self.run_id)
        self.certs[body.version] = raw
        state = self.results.get(done.state_hash)
        if state is not None:
            state.cert = cert
        log.info(
            "version %d certified by %d/%d syncers%s",
            body.version,
            len(done.signers),
            len(body.committee),
            "" if done.agreed_with_quorum else " (this syncer's merge differed or was late)",
        )
        self.on_certified(raw, state)

    def _reject(self, peer: str, digest: str | None, reason: str) -> None:
        log.warning("rejected input from %s: %s", peer, reason)
        version = self.current.version + 1 if self.current is not None else None
        self.rejections.append(
            {"peer_id": peer, "digest": digest, "reason": reason[:300], "round": version}
        )
        del self.rejections[:-MAX_REJECTIONS_KEPT]

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick)
            if self.round is not None:
                try:
                    await self._execute(self.round.on_tick(time.monotonic()))
                except Exception:
                    log.exception("round tick failed")
