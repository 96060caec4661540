"""One outer round on one syncer, as a sans-IO state machine.

The machine never touches the network, the clock or tensors: a driver feeds it events (a
submission arrived, the leader proposed an input set, the aggregate was computed, a fellow syncer
signed, time passed) and carries out the actions it returns (reject and log, fast-forward a stale
learner, propose, fetch, aggregate, sign, publish a certificate). The asyncio node, the
multi-process tests and a discrete-event simulator of thousands of peers all drive this class.

Phases of the round that turns certified version v into v+1:

    COLLECTING  submissions are screened (run, base version, token claim, duplicates); the round
                closes ``linger`` seconds after ceil(min_fraction × active learners) are
                accepted (at once when every active learner is in), or at the grace deadline
                with at least one;
    AGREEING    the leader (committee order, rotating to the next member every ``agree_timeout``
                without a proposal) proposes the sorted digests of its accepted submissions; the
                others adopt that set, fetching what they miss;
    AGGREGATING the driver merges exactly that set (weights from ``weights()``) and reports the
                resulting state hash;
    SIGNING     signatures over (run, v+1, state hash) are collected; q = floor(2k/3)+1 matching
                ones certify the version, whatever this syncer computed itself;
    CERTIFIED   done. ``DONE`` actions carry the certified hash and its signers.

Stale submissions (base older than v − staleness) are rejected and their sender fast-forwarded;
fresher-but-behind ones (v − staleness ≤ base < v) are accepted at weight 1/(1 + v − base).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from p2pdiloco.sync.weights import capped_weights


class Phase(enum.Enum):
    COLLECTING = "collecting"
    AGREEING = "agreeing"
    AGGREGATING = "aggregating"
    SIGNING = "signing"
    CERTIFIED = "certified"


@dataclass(frozen=True)
class RoundParams:
    """Everything fixed for the round, from the run manifest and the last certificate."""

    run_id: str
    version: int  # v: the certified base; this round produces v + 1
    committee: tuple[str, ...]  # elected syncers, leader first
    quorum: int  # signatures that certify
    active_learners: int  # learners alive at round start (heartbeats)
    opened_at: float  # when the round started collecting
    grace: float = 60.0  # seconds after opening at which the round closes with what it has
    min_fraction: float = 0.6  # share of active learners that closes the round early
    staleness: int = 2  # oldest base version accepted: v − staleness
    max_tokens_per_step: int = 2**20  # batch × seq_len: bounds a token claim by steps
    weight_cap: float = 0.25  # no learner weighs more than this share of the merge
    agree_timeout: float = 20.0  # seconds without a proposal before the next leader takes over
    linger: float = 0.0  # once the quorum of learners is in, wait this long for stragglers

    @property
    def min_learners(self) -> int:
        return max(1, math.ceil(self.min_fraction * self.active_learners))


@dataclass(frozen=True)
class Submission:
    """A learner's signed header (signature already checked by the transport)."""

    peer_id: str
    run_id: str
    base_version: int
    steps: int
    tokens: int
    digest: str  # hash of the compressed payload, which the driver stores by digest


# -- actions returned to the driver ---------------------------------------------------------


@dataclass(frozen=True)
class Reject:
    peer_id: str
    reason: str


@dataclass(frozen=True)
class FastForward:
    peer_id: str
    to_version: int


@dataclass(frozen=True)
class Propose:
    digests: tuple[str, ...]


@dataclass(frozen=True)
class Fetch:
    digests: tuple[str, ...]
    from_peer: str


@dataclass(frozen=True)
class Aggregate:
    digests: tuple[str, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True)
class Sign:
    version: int
    state_hash: str


@dataclass(frozen=True)
class Done:
    version: int
    state_hash: str
    signers: tuple[str, ...]
    agreed_with_quorum: bool  # False: this syncer's own hash differed from the certified one


Action = Reject | FastForward | Propose | Fetch | Aggregate | Sign | Done


@dataclass
class SyncerRound:
    """The round as seen by syncer ``me`` (one of ``params.committee``)."""

    params: RoundParams
    me: str
    phase: Phase = Phase.COLLECTING
    accepted: dict[str, Submission] = field(default_factory=dict)  # by digest
    closed_at: float | None = None
    enough_at: float | None = None  # when the learner quorum was first reached
    input_set: tuple[str, ...] | None = None
    own_hash: str | None = None
    signatures: dict[str, str] = field(default_factory=dict)  # syncer → state hash

    def __post_init__(self) -> None:
        if self.me not in self.params.committee:
            raise ValueError(f"{self.me} is not on this round's committee")
        if not 1 <= self.params.quorum <= len(self.params.committee):
            raise ValueError("quorum must be between 1 and the committee size")

    # -- events ----------------------------------------------------------------------------

    def on_submission(self, sub: Submission, now: float) -> list[Action]:
        """Screen one submission header; accepted ones wait for the round to close."""
        reason = self._screen(sub)
        if reason is not None:
            actions: list[Action] = [Reject(sub.peer_id, reason)]
            if sub.base_version < self.params.version - self.params.staleness:
                actions.append(FastForward(sub.peer_id, self.params.version))
            return actions
        self.accepted[sub.digest] = sub
        return self._maybe_close(now)

    def on_tick(self, now: float) -> list[Action]:
        """Time passed: close at the grace deadline; rotate the leader if agreement stalls."""
        if self.phase is Phase.COLLECTING:
            return self._maybe_close(now)
        if self.phase is Phase.AGREEING and self.leader(now) == self.me and self.accepted:
            return self._propose()
        return []

    def on_proposal(self, sender: str, digests: tuple[str, ...], now: float) -> list[Action]:
        """The leader's input set: adopt it (fetching what is missing) and aggregate."""
        if self.phase not in (Phase.COLLECTING, Phase.AGREEING):
            return []
        if sender != self.leader(now):
            return [Reject(sender, "proposal from a syncer that is not the current leader")]
        if not digests or list(digests) != sorted(set(digests)):
            return [Reject(sender, "malformed input set (empty, unsorted or repeated)")]
        self.closed_at = self.closed_at if self.closed_at is not None else now
        self.input_set = digests
        self.phase = Phase.AGREEING
        missing = tuple(d for d in digests if d not in self.accepted)
        if missing:
            return [Fetch(missing, sender)]
        return [self._aggregate()]

    def on_fetched(self, sub: Submission) -> list[Action]:
        """A submission fetched from a fellow syncer (header re-checked like any other)."""
        if self.phase is not Phase.AGREEING or self.input_set is None:
            return []
        if sub.digest not in self.input_set:
            return [Reject(sub.peer_id, "fetched submission is not in the agreed input set")]
        reason = self._screen(sub, allow_after_close=True)
        if reason is not None:
            return [Reject(sub.peer_id, reason)]
        self.accepted[sub.digest] = sub
        if all(d in self.accepted for d in self.input_set):
            return [self._aggregate()]
        return []

    def on_aggregated(self, state_hash: str) -> list[Action]:
        """The driver merged the input set and applied the outer step: sign the result."""
        if self.phase is not Phase.AGGREGATING:
            return []
        self.own_hash = state_hash
        self.phase = Phase.SIGNING
        actions: list[Action] = [Sign(self.params.version + 1, state_hash)]
        return actions + self.on_signature(self.me, state_hash)

    def on_signature(self, syncer: str, state_hash: str) -> list[Action]:
        """A verified signature of a committee member over (run, v+1, state_hash)."""
        if syncer not in self.params.committee:
            return [Reject(syncer, "signature from outside the committee")]
        if self.phase is Phase.CERTIFIED:
            return []
        if syncer in self.signatures and self.signatures[syncer] != state_hash:
            return [Reject(syncer, "signed two different states in one round (equivocation)")]
        self.signatures[syncer] = state_hash
        signers = tuple(sorted(s for s, h in self.signatures.items() if h == state_hash))
        if len(signers) < self.params.quorum:
            return []
        self.phase = Phase.CERTIFIED
        return [Done(self.params.version + 1, state_hash, signers, self.own_hash == state_hash)]

    # -- views -----------------------------------------------------------------------------

    def leader(self, now: float) -> str:
        """Committee member expected to propose at ``now``: the first, then the next one after
        each ``agree_timeout`` without agreement."""
        start = self.closed_at if self.closed_at is not None else now
        turn = max(0, int((now - start) // self.params.agree_timeout))
        return self.params.committee[turn % len(self.params.committee)]

    def weights(self, digests: tuple[str, ...]) -> tuple[float, ...]:
        """Merge weights: tokens, discounted by staleness, capped per learner."""
        raw = {}
        for d in digests:
            sub = self.accepted[d]
            lag = self.params.version - sub.base_version
            raw[d] = sub.tokens / (1 + lag)
        capped = capped_weights(raw, self.params.weight_cap)
        return tuple(capped[d] for d in digests)

    # -- internals -------------------------------------------------------------------------

    def _screen(self, sub: Submission, allow_after_close: bool = False) -> str | None:
        p = self.params
        if sub.run_id != p.run_id:
            return "submission for another run"
        if self.phase is not Phase.COLLECTING and not allow_after_close:
            return f"round for version {p.version + 1} is already closed"
        if sub.base_version > p.version:
            return f"base version {sub.base_version} is newer than the certified {p.version}"
        if sub.base_version < p.version - p.staleness:
            return f"stale: base version {sub.base_version} is older than {p.version - p.staleness}"
        if sub.steps < 1 or sub.tokens < 1:
            return "a submission must report at least one step and one token"
        if sub.tokens > sub.steps * p.max_tokens_per_step:
            return (
                f"token claim {sub.tokens} exceeds steps × batch × seq_len "
                f"({sub.steps} × {p.max_tokens_per_step})"
            )
        if sub.digest in self.accepted:
            return "duplicate submission"
        if not allow_after_close and any(s.peer_id == sub.peer_id for s in self.accepted.values()):
            return "a second submission from the same learner in one round"
        return None

    def _maybe_close(self, now: float) -> list[Action]:
        p = self.params
        enough = len(self.accepted) >= p.min_learners
        if enough and self.enough_at is None:
            self.enough_at = now
        everyone = len(self.accepted) >= p.active_learners
        lingered = enough and self.enough_at is not None and now >= self.enough_at + p.linger
        deadline = now >= p.opened_at + p.grace and len(self.accepted) > 0
        if self.phase is not Phase.COLLECTING or not (everyone or lingered or deadline):
            return []
        self.phase = Phase.AGREEING
        self.closed_at = now
        return self._propose() if self.leader(now) == self.me else []

    def _propose(self) -> list[Action]:
        """Leader: announce the input set and aggregate it ourselves."""
        digests = tuple(sorted(self.accepted))
        self.input_set = digests
        return [Propose(digests), self._aggregate()]

    def _aggregate(self) -> Aggregate:
        assert self.input_set is not None
        self.phase = Phase.AGGREGATING
        return Aggregate(self.input_set, self.weights(self.input_set))
