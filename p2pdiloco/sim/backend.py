"""What a simulated syncer computes when the round says ``Aggregate``.

``MetadataMerge`` (10,000 peers): no tensors; the state hash is a hash of the base state, the
input set and its weights, so syncers that merge the same set with the same weights sign the
same state, as honest syncers do with real tensors (ADR 0005), and a faulty syncer signs
another. ``TensorMerge``: the network syncer's own tensor path (``sync.certified.next_state``)
on real deltas, so a small case can be checked against the real network bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from p2pdiloco.compress.wire import pack_deltas
from p2pdiloco.core.round import Aggregate, Submission
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.submissions import (
    FragmentRef,
    SubmissionHeader,
    open_submission,
    payload_digest,
    seal_submission,
)
from p2pdiloco.sim.config import identity
from p2pdiloco.sync.aggregator import MergeError, MergeInput
from p2pdiloco.sync.certified import (
    CertifiedState,
    certified_params_hash,
    genesis_state,
    next_state,
)
from p2pdiloco.sync.fragments import round_fragment, round_shapes
from p2pdiloco.sync.intake import Intake
from p2pdiloco.train.outer import OuterConfig


class MergeFailed(Exception):
    def __init__(self, screened_out: frozenset[str]) -> None:
        super().__init__("no input survived screening")
        self.screened_out = screened_out


@dataclass(frozen=True)
class Outcome:
    state_hash: str
    merged: tuple[str, ...]  # digests merged (the input set less those screened out)
    screened_out: dict[str, str]  # digest → why screening refused it
    update_hash: str | None = None  # the certified update's hash (tensor mode only)
    params_hash: str | None = None  # the parameters' hash of "params" updates (ADR 0064)


class Merge(Protocol):
    def bind(self, run_id: str, manifest: RunManifest) -> None:
        """The run the simulation made (called once, before anything else)."""

    def genesis_hash(self) -> str: ...

    def seal(self, index: int, sub: Submission, serial: int, at: float) -> Submission:
        """Learner ``index``'s ``serial``-th delta with header ``sub``, sent at simulated time
        ``at`` (seconds since the run's creation): the submission as sent (its digest filled
        in). A seed gives the same digests, so the same beacons and elections, every run."""
        ...

    def merge(self, base_hash: str, agg: Aggregate, subs: Mapping[str, Submission]) -> Outcome:
        """The state the input set of ``agg`` merges into; MergeFailed if screening refuses
        every input."""
        ...


def _hash(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@dataclass
class MetadataMerge:
    """Screening takes out the submissions of ``poisoned`` learners (what the real screen does
    to a sign-flip or scaled delta); the rest merge into a state named by its inputs."""

    poisoned: frozenset[str] = frozenset()  # peer ids whose deltas screening refuses

    def bind(self, run_id: str, manifest: RunManifest) -> None:
        self.run_id = run_id

    def genesis_hash(self) -> str:
        return _hash("genesis", self.run_id)

    def seal(self, index: int, sub: Submission, serial: int, at: float) -> Submission:
        return replace(sub, digest=hashlib.sha256(f"{sub.peer_id}/{serial}".encode()).hexdigest())

    def merge(self, base_hash: str, agg: Aggregate, subs: Mapping[str, Submission]) -> Outcome:
        digests, weights = agg.digests, agg.weights
        out = tuple(d for d in digests if subs[d].peer_id in self.poisoned)
        dropped = frozenset(out)  # sets: 10,000 inputs checked against tuples took 30 s a run
        kept = tuple(d for d in digests if d not in dropped)
        if not kept:
            raise MergeFailed(dropped)
        w = tuple(round(x, 12) for d, x in zip(digests, weights, strict=True) if d not in dropped)
        return Outcome(_hash(base_hash, kept, w), kept, dict.fromkeys(out, "poisoned (simulated)"))


@dataclass
class TensorMerge:
    """Learners send seeded random deltas (scale ``delta_scale``), compressed with the run's
    codec and sealed with their real keys (``sim.config.identity``); syncers decode them as the
    network's intake does and merge with the network syncer's tensor path. Payloads, sealed
    headers and states are kept, so a test can replay any round on a real syncer."""

    seed: int = 0
    delta_scale: float = 1e-3
    payloads: dict[str, bytes] = field(default_factory=dict)  # digest → payload
    sealed: dict[str, bytes] = field(default_factory=dict)  # digest → signed header
    states: dict[str, CertifiedState] = field(default_factory=dict)

    def bind(self, run_id: str, manifest: RunManifest) -> None:
        self.run_id, self.manifest = run_id, manifest
        self.genesis = genesis_state(manifest)
        shapes = {n: tuple(t.shape) for n, t in self.genesis.params.items()}
        self.intake = Intake(manifest, shapes, run_id)
        self.states[self.genesis.state_hash] = self.genesis
        o = manifest.outer
        self.outer = OuterConfig(**o.model_dump())  # lr, momentum, nesterov, P

    def genesis_hash(self) -> str:
        return self.genesis.state_hash

    def seal(self, index: int, sub: Submission, serial: int, at: float) -> Submission:
        key = hashlib.sha256(f"{self.seed}/{index}/{serial}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key[:7], "big"))
        shapes = round_shapes(self.intake.shapes, self.outer.fragments, sub.base_version)
        delta = {n: self.delta_scale * torch.randn(s, generator=gen) for n, s in shapes.items()}
        codec = self.intake.codec
        payload = pack_deltas({n: codec.encode(delta[n]) for n in sorted(delta)})
        fragment = round_fragment(sub.base_version, self.outer.fragments)
        header = SubmissionHeader(
            peer_id=sub.peer_id, base_version=sub.base_version, steps=sub.steps,
            tokens=sub.tokens, loss=3.0, codec=self.manifest.compression,
            fragments=[FragmentRef(index=fragment, digest=payload_digest(payload),
                                   nbytes=len(payload))],
        )  # fmt: skip
        # Signed at the simulated time, not the wall clock: the digest (and through the
        # certificates, every later beacon and election) is then the same for a seed.
        ts = self.manifest.created_at + at
        raw = seal_submission(identity(self.seed, index), self.run_id, header, ts=ts)
        digest = open_submission(raw, run_id=self.run_id).digest
        self.payloads[digest], self.sealed[digest] = payload, raw
        return replace(sub, digest=digest)

    def merge(self, base_hash: str, agg: Aggregate, subs: Mapping[str, Submission]) -> Outcome:
        base = self.states[base_hash]
        inputs = [
            MergeInput(digest=d, peer_id=subs[d].peer_id,
                       delta=self.intake.decode(self.payloads[d], base.version), weight=w,
                       trusted=a)
            for d, w, a in zip(agg.digests, agg.weights, agg.anchors(), strict=True)
        ]  # fmt: skip
        try:
            result, state = next_state(base, inputs, self.manifest.rules, self.outer)
        except MergeError as e:
            raise MergeFailed(frozenset(e.rejected)) from e
        self.states.setdefault(state.state_hash, state)
        return Outcome(
            state.state_hash,
            tuple(result.accepted),
            dict(result.rejected),
            state.update_hash,
            certified_params_hash(state, self.manifest.rules),
        )
