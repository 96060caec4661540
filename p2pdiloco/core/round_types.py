"""The values a ``SyncerRound`` takes and returns: parameters, inputs, actions, status.

Kept apart from the state machine (``core/round.py``) so that drivers and the simulator can
import the vocabulary without the logic; ``core/round.py`` re-exports every name here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from p2pdiloco.core.trust import probation_room
from p2pdiloco.protocol.certificates import MAX_RECEIPTS
from p2pdiloco.protocol.reasons import Reason


class Phase(enum.Enum):
    COLLECTING = "collecting"
    AGREEING = "agreeing"
    AGGREGATING = "aggregating"
    SIGNING = "signing"
    CERTIFIED = "certified"


# Payload bytes a member holds for one round at most (local, not consensus): the round's
# ``max_inputs`` is this over the largest payload, within [MIN_HELD, MAX_RECEIPTS]; a full
# round refuses with BUSY and the learner moves on to the next member (ADR 0046, ADR 0047).
HELD_BYTES = 8 << 30
MIN_HELD = 16


def held_cap(max_payload: int) -> int:
    """A round's ``max_inputs`` for payloads of at most ``max_payload`` bytes."""
    return max(MIN_HELD, min(MAX_RECEIPTS, HELD_BYTES // max(1, max_payload)))


@dataclass(frozen=True)
class RoundParams:
    """Everything fixed for the round, from the run manifest and the last certificate.

    The driver fills **every** field: the consensus ones from the signed manifest's ``rules``
    (``grace``, ``linger``, ``agree_timeout``, ``weight_cap``, ``staleness``,
    ``min_fraction`` ← ``rules.min_quorum_fraction``), the token bound from its inner config.
    The defaults exist only so tests can name what they vary; a driver that leans on one runs
    rules its peers may not share, and its signatures will not match theirs.
    """

    run_id: str
    version: int  # v: the certified base; this round produces v + 1
    committee: tuple[str, ...]  # elected syncers, leader first
    quorum: int  # signatures that certify
    active_learners: int  # learners alive at round start (heartbeats)
    opened_at: float  # when the round started collecting
    grace: float = 60.0  # seconds after an attempt opens at which it closes with what it has
    # Seconds after which this syncer closes an attempt with what it has: ``grace``, or less
    # under the adaptive grace (core.arrivals); None: ``grace``. Deadlines that estimate when
    # *another* syncer closes keep ``grace``, the bound every syncer shares.
    close_after: float | None = None
    min_fraction: float = 0.6  # share of active learners that closes the round early
    staleness: int = 0  # oldest base version accepted: v − staleness (ADR 0026)
    max_tokens_per_step: int = 2**20  # batch × seq_len: bounds a token claim by steps
    max_steps: int = 2**30  # the manifest's H: a larger steps claim is clipped (plausible_claim)
    weight_cap: float = 0.25  # no learner weighs more than this share of the merge
    agree_timeout: float = 20.0  # seconds without a proposal before the next leader takes over
    linger: float = 0.0  # once the quorum of learners is in, wait this long for stragglers
    # Memory bounds (local, not consensus): a full round refuses with BUSY and closes.
    max_inputs: int = MAX_RECEIPTS  # accepted submissions held (a member: ``held_cap``)
    max_dropped: int = 16384  # dropped digests remembered (oldest forgotten first)
    # A later view bound to re-certify a locked content (protocol.view_change): its input set.
    # The round starts agreed on it: no collecting, no proposal, no further attempts.
    locked: tuple[str, ...] | None = None
    # Trust (core.trust): the identities whose submissions close the round and anchor its
    # screening; None (a young run) trusts everyone. The rest share ``probation_share``.
    trusted: frozenset[str] | None = None
    probation_share: float = 0.25
    # Probationary inputs an input set may always hold (``core.trust.probation_room``): 1 in
    # a run that scores work, whose probationary deltas are merged only if they show work on
    # their own data (ADR 0066), so a newcomer can earn trust next to one trusted learner.
    probation_floor: int = 0
    # Trusted learners alive (``core.trust.trusted_count``); None: ``active_learners``. The
    # learner quorum is a share of these: probationary ones never close a round, so a flood of
    # them counted in would keep every round open to its grace.
    trusted_learners: int | None = None
    # Accepted deltas each identity has on the certified roster (``core.trust.trust_progress``):
    # the leader fills the probation room with the submissions of the identities closest to
    # trust first, arrival order between equals (ADR 0040). None: arrival order. Not consensus:
    # which probationary inputs a leader proposes is its choice, within ``probation_room``.
    progress: Mapping[str, int] | None = field(default=None, compare=False)
    # Certified eval (ADR 0059): a member other than the leader signs the leader's body, whose
    # eval loss must lie within this × max(1, its own) of its own; None: the run evaluates
    # nothing and every member signs the body it merged.
    eval_tolerance: float | None = None

    def is_trusted(self, peer_id: str) -> bool:
        return self.trusted is None or peer_id in self.trusted

    def room(self, trusted: int) -> int:
        """Probationary inputs an input set may hold next to ``trusted`` trusted ones."""
        return probation_room(trusted, self.probation_share, self.probation_floor)

    @cached_property  # read at every submission; the params are frozen
    def trusted_live(self) -> int:
        return self.active_learners if self.trusted_learners is None else self.trusted_learners

    @cached_property
    def min_learners(self) -> int:
        """Trusted submissions that close the round ``linger`` later (never more than fit)."""
        wanted = max(1, math.ceil(self.min_fraction * self.trusted_live))
        return min(wanted, self.max_inputs)


@dataclass(frozen=True)
class Submission:
    """A learner's signed header (signature already checked by the transport)."""

    peer_id: str
    run_id: str
    base_version: int
    steps: int
    tokens: int
    digest: str  # hash of the compressed payload, which the driver stores by digest


class Standing(enum.StrEnum):
    PENDING = "pending"  # held by the round: waiting for the close, or in the set being merged
    DROPPED = "dropped"  # refused after acceptance (a failed merge); will not be taken again
    UNKNOWN = "unknown"  # never accepted here, or forgotten (see RoundParams.max_dropped)


@dataclass(frozen=True)
class SubmissionStatus:
    """Answer to ``SyncerRound.status_of``: a learner polls this to learn its delta's fate."""

    standing: Standing
    code: Reason | None = None  # why it was dropped; None unless DROPPED

    def reply(self) -> dict[str, str]:
        """The answer to a learner's "receipt" request (``SyncService``)."""
        if self.standing is Standing.DROPPED and self.code is not None:
            return {"status": "dropped", "code": self.code.value}
        return {"status": self.standing.value}


# -- actions returned to the driver ---------------------------------------------------------


@dataclass(frozen=True)
class Reject:
    """Tell ``peer_id`` (a learner, or a syncer for committee messages) it was refused."""

    peer_id: str
    code: Reason  # what callers branch on
    reason: str  # human text for logs and dashboards only


@dataclass(frozen=True)
class FastForward:
    peer_id: str
    to_version: int


@dataclass(frozen=True)
class Clipped:
    """An accepted submission claimed more steps than one delta holds: it counts (in the merge
    weights and the certificate) with the clipped claim. For the driver to record and report."""

    peer_id: str
    digest: str
    claimed: tuple[int, int]  # (steps, tokens) as signed by the learner
    counted: tuple[int, int]  # (steps, tokens) after clipping


@dataclass(frozen=True)
class Propose:
    """Send the input set of ``attempt`` to the other committee members."""

    digests: tuple[str, ...]
    attempt: int


@dataclass(frozen=True)
class Fetch:
    digests: tuple[str, ...]
    from_peer: str


@dataclass(frozen=True)
class Aggregate:
    """Merge exactly these submissions with these weights; report back with ``on_aggregated``
    or ``on_merge_failed``, passing ``attempt`` so a late answer cannot land in a newer one."""

    digests: tuple[str, ...]
    weights: tuple[float, ...]
    attempt: int
    trusted: tuple[bool, ...] = ()  # per digest: anchors screening (core.trust); () all

    def anchors(self) -> tuple[bool, ...]:
        """Per digest, whether its norm anchors screening (a trusted sender)."""
        return self.trusted or (True,) * len(self.digests)


@dataclass(frozen=True)
class Dropped:
    """These submissions left the round (a failed merge, or evicted from a full round): forget
    their payloads. May name digests the driver never held (an adopted set not yet fetched)."""

    digests: tuple[str, ...]


@dataclass(frozen=True)
class Evaluated:
    """A merged body's content (``certificates.content_digest``: without view, committee and
    eval loss) and the loss its signer measured on the held-out batches (ADR 0059)."""

    content: str
    loss: float


@dataclass(frozen=True)
class Sign:
    version: int
    state_hash: str


@dataclass(frozen=True)
class Done:
    version: int
    state_hash: str
    signers: tuple[str, ...]
    # True iff this syncer's latest successful merge produced the certified state (it holds
    # it); False: its hash differed, or its merge failed or was abandoned (fetch the state).
    agreed_with_quorum: bool


Action = Reject | FastForward | Clipped | Propose | Fetch | Aggregate | Dropped | Sign | Done
