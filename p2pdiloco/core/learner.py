"""The learner side of the outer loop, as a sans-IO state machine beside ``SyncerRound``.

It never touches tensors, the network or the clock: the training thread feeds it events (steps
trained, a delta sealed, the committee's reply, a certified version, a dropped delta, the time)
and carries out what it returns. The same class runs in ``join``, in the in-memory driver tests
and in the simulator.

    train ──H steps──▶ send Δ (from base v) ──▶ in flight: keep training, past H if need be
       ▲                                              │
       │           certificate of v' > v ◀────────────┤ (ours merged: rebase onto v' anchored at
       │                                              │  the sent parameters; not merged: the
       │                                              │  sent steps are carried into the next Δ)
       └──────── refused / dropped / given up ◀───────┘ (rebase onto v itself: the sent part
                                                         is dropped, later progress kept)

A certificate that lands while no delta is in flight rebases the stretch under way onto it
(all local progress carried). ``next_action`` says what to do now: train a chunk or send; it
waits only once the target version is reached. A learner never waits on the network: with a
delta in flight and a whole stretch trained since (overtime, say while a view change hands the
version to the next committee), it trains on, and its next delta holds every step since the
last one (claiming at most H, as syncers clip: ADR 0010). ``Send.overtime`` counts the steps
trained in overtime and ``Send.carried`` those carried from an unmerged delta: the driver folds
such a delta to one stretch's norm (ADRs 0019, 0026), so every delta a syncer screens has the
scale of one stretch however long the round took or however late the last delta came. A delta
undecided for ``give_up_after`` seconds is given up, so a learner is never tied to a round that
died.

A delta that a certificate did not merge (held by some syncers, but outside the agreed input
set) has its work carried into the learner's next delta rather than thrown away
(docs/adr/0014-late-deltas-are-carried.md), once no later round may merge it (its base is
older than the staleness bound: at once with the default staleness 0, ADR 0026); so is one
refused only because it came late (ROUND_CLOSED, STALE). Any other refusal drops it at once, so
the learner's next delta goes out without waiting (a later view's committee needs it).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from p2pdiloco.protocol.reasons import RETRYABLE, TIMING, Reason
from p2pdiloco.protocol.records import RunManifest


class LearnerPhase(enum.Enum):
    TRAINING = "training"  # no delta in flight
    IN_FLIGHT = "waiting for certificate"  # a delta sent; training on
    OVERTIME = "training on (stretch done)"  # a delta in flight and a stretch trained since
    IDLE = "idle"  # the target version is reached


@dataclass(frozen=True)
class Train:
    steps: int


@dataclass(frozen=True)
class Send:
    """Take Δ = θ_base − θ_local now, seal it and hand it to the runtime; then ``on_sent``."""

    base_version: int
    steps: int  # inner steps the delta covers
    overtime: int = 0  # of those, steps trained while the previous delta was undecided
    carried: int = 0  # of those, steps of an earlier delta no certificate merged


@dataclass(frozen=True)
class Wait:
    seconds: float


@dataclass(frozen=True)
class Rebase:
    """Move onto certified ``version`` (the driver holds its state). ``anchor_sent``: the delta
    in flight is settled by it, so rebase from the parameters as sent; else from the old base.
    ``seek_step``: put the inner lr schedule at this global step (the run's pace is known, or
    versions were skipped); None: keep the learner's own count."""

    version: int
    anchor_sent: bool
    merged: bool  # our delta in flight is among the certified version's inputs
    seek_step: int | None
    # Steps of the delta in flight that the certificate did not merge: carried into the next
    # delta (rebase from the old base, error feedback restored), 0 when merged or none in flight.
    carried: int = 0


@dataclass(frozen=True)
class Drop:
    """The delta in flight will not be merged: rebase onto the same base from the parameters as
    sent (the sent part is dropped, the progress since kept)."""

    code: Reason


@dataclass(frozen=True)
class CatchUp:
    """A syncer said a newer version exists (fast-forward hint): ask the runtime for it."""

    version: int


LearnerAction = Train | Send | Wait | Rebase | Drop | CatchUp


@dataclass
class InFlight:
    base_version: int
    sent_at: float
    steps: int = 0  # inner steps the delta covers
    overtime: int = 0  # of those, steps trained in overtime (the delta was folded)
    carried: int = 0  # of those, steps carried from a delta no certificate merged
    digest: str | None = None  # set by ``on_sent``
    accepted_by_some: bool = False
    late: Reason | None = None  # a syncer said it came late (ROUND_CLOSED, STALE)


@dataclass
class LearnerMachine:
    inner_steps: int  # H: steps per delta
    chunk: int  # steps per Train action (how often events are looked at)
    version: int  # the certified version the learner trains from
    give_up_after: float = 300.0  # seconds a delta may stay undecided
    stop_at: int | None = None  # stop training once this version is applied
    time_budget: float | None = None  # seconds of training per stretch (manifest); None: H only
    # The manifest's staleness s: the round after version v accepts bases down to v − s, so a
    # delta on base b that a certificate of v did not merge may still be merged while b ≥ v − s
    # (it is then not carried: its work would count twice, ADR 0026).
    staleness: int = 0
    # The manifest's fragments P (ADR 0032): each delta is one fragment's, holding the steps
    # since that fragment was last synced; an unmerged one is not carried into the next delta
    # (another fragment's): its progress stays in the parameters for its fragment's next round.
    fragments: int = 1
    trained: int = 0  # steps since the last send
    trained_seconds: float = 0.0  # seconds spent training those steps
    seconds_per_step: float | None = None  # measured over the last chunks (budget sizing)
    overtime: int = 0  # steps trained since the last send while a delta was in flight past H
    carried: int = 0  # of ``trained``, steps carried from a delta no certificate merged
    _overtime_chunk: bool = field(default=False, repr=False)  # the Train out is overtime
    in_flight: InFlight | None = None
    sent: int = field(default=0)
    merged: int = field(default=0)
    lost: int = field(default=0)  # refused, dropped, given up, or missing from the certificate
    # Of ``lost``, the deltas that came too late, by reason: given up, refused for timing
    # (``TIMING``), or left out of the certificate without being rejected by it. The others
    # were refused: by a syncer, a merge, or the certificate's rejected list.
    late: dict[Reason, int] = field(default_factory=dict)

    @classmethod
    def for_run(
        cls,
        manifest: RunManifest,
        version: int,
        *,
        inner_steps: int | None = None,
        chunk: int | None = None,
        stop_at: int | None = None,
    ) -> LearnerMachine:
        """The machine of a learner of ``manifest`` from certified ``version``: a delta every
        H/P steps (``inner_steps`` overrides H, as test networks do), in chunks of a quarter of
        that when it divides evenly (``chunk`` overrides), the manifest's budget, staleness and
        give-up time."""
        fragments = manifest.outer.fragments
        stretch = max(1, (inner_steps or manifest.inner_steps) // fragments)
        if chunk is None:
            chunk = max(1, stretch // 4) if stretch % 4 == 0 else stretch
        return cls(
            inner_steps=stretch,
            chunk=max(1, min(chunk, stretch)),
            version=version,
            give_up_after=manifest.rules.give_up_after,
            stop_at=stop_at,
            time_budget=manifest.time_budget,
            staleness=manifest.rules.staleness,
            fragments=fragments,
        )

    def __post_init__(self) -> None:
        if self.inner_steps < 1 or self.chunk < 1:
            raise ValueError("inner_steps and chunk must be at least 1")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError("time_budget must be positive")

    @property
    def phase(self) -> LearnerPhase:
        if self.stop_at is not None and self.version >= self.stop_at:
            return LearnerPhase.IDLE
        if self.in_flight is None:
            return LearnerPhase.TRAINING
        if self.stretch_done:
            return LearnerPhase.OVERTIME
        return LearnerPhase.IN_FLIGHT

    @property
    def stretch_done(self) -> bool:
        """H steps trained since the last send, or (budgeted) at least one step and the budget,
        or carried work: a delta no certificate merged holds a whole stretch already, so it goes
        out at once, early in the next round (in step with the others it would miss that round
        by as much as it missed the last one, every round: seen under CI load)."""
        if self.trained >= self.inner_steps:
            return True
        budget = self.time_budget
        if budget is None or self.trained <= 0:
            return False
        return self.trained_seconds >= budget or self.carried > 0

    @property
    def budget_left(self) -> float | None:
        """Seconds of the time budget left before this stretch's delta is due; None without a
        budget, with a delta in flight (the stretch's end sends nothing) or once it is done."""
        if self.time_budget is None or self.in_flight is not None or self.stretch_done:
            return None
        return max(0.0, self.time_budget - self.trained_seconds)

    # -- what to do now ------------------------------------------------------------------------

    def next_action(self, now: float) -> list[LearnerAction]:
        phase = self.phase
        if phase is LearnerPhase.IDLE:
            return [Wait(1.0)]
        if phase is LearnerPhase.OVERTIME:
            assert self.in_flight is not None
            if now - self.in_flight.sent_at >= self.give_up_after:
                return [*self._lose(Reason.ROUND_CLOSED), *self.next_action(now)]
        if self.in_flight is None and self.stretch_done:
            steps, over = self.trained, min(self.overtime, self.trained)
            carried = min(self.carried, steps - over)
            self.trained, self.trained_seconds, self.overtime = 0, 0.0, 0
            self.in_flight = InFlight(self.version, now, steps, over, carried)
            self.carried = 0
            self.sent += 1
            return [Send(self.version, steps, over, carried)]
        self._overtime_chunk = phase is LearnerPhase.OVERTIME
        return [Train(self._chunk())]

    def _chunk(self) -> int:
        """Steps of the next Train: a chunk, never past H, and (budgeted) about what still fits
        in the budget at the measured pace (one step while the pace is unknown), at most a
        quarter of the budget, so a certificate is looked at soon. In overtime a whole chunk
        (budgeted: a quarter of the budget)."""
        overtime = self.stretch_done
        steps = min(self.chunk, self.inner_steps if overtime else self.inner_steps - self.trained)
        if self.time_budget is None:
            return steps
        if self.seconds_per_step is None:
            return 1
        quarter = self.time_budget / 4
        left = quarter if overtime else min(quarter, self.time_budget - self.trained_seconds)
        return max(1, min(steps, int(left / max(self.seconds_per_step, 1e-9) + 0.5)))

    # -- events --------------------------------------------------------------------------------

    def on_trained(self, steps: int, seconds: float = 0.0) -> None:
        """``steps`` inner steps were trained in ``seconds`` (wall time of the chunk)."""
        self.trained += steps
        self.trained_seconds += max(0.0, seconds)
        if self._overtime_chunk:
            self.overtime += steps
            self._overtime_chunk = False
        if steps > 0 and seconds > 0:
            pace = seconds / steps
            old = self.seconds_per_step
            self.seconds_per_step = pace if old is None else 0.5 * old + 0.5 * pace

    def on_progress_lost(self) -> None:
        """The steps trained since the last send (or the base) are gone (an island re-formed
        from the last certified state): the stretch starts again."""
        self.trained, self.trained_seconds, self.overtime, self.carried = 0, 0.0, 0, 0
        self._overtime_chunk = False

    def on_sent(self, digest: str) -> None:
        """The delta of the last ``Send`` was sealed as submission ``digest``."""
        if self.in_flight is not None and self.in_flight.digest is None:
            self.in_flight.digest = digest

    def on_reply(
        self, digest: str, accepted: bool, code: Reason | None, fast_forward: int | None
    ) -> list[LearnerAction]:
        """The committee's answer to our submission (summed up by the runtime: accepted by at
        least one syncer, or refused by every one that answered)."""
        fly = self.in_flight
        if fly is None or fly.digest != digest:
            return []
        if accepted:
            fly.accepted_by_some = True
            return []
        if code in RETRYABLE:
            return []  # the runtime sends it again
        if code in (Reason.ROUND_CLOSED, Reason.STALE):
            fly.late = code
            # Late for its round, not bad: the certificate will not merge it, and then its steps
            # are carried into the next delta (ADR 0014) instead of being thrown away now
            # (the simulator's finding: docs/adr/0021-network-simulator.md). STALE: the syncer
            # is rounds ahead; fetch the version it names, whose certificate carries it.
            if fast_forward is not None and fast_forward > self.version:
                return [CatchUp(fast_forward)]
            return []
        newer: list[LearnerAction] = []
        if fast_forward is not None and fast_forward > self.version:
            newer.append(CatchUp(fast_forward))
        return [*self._lose(code or Reason.MALFORMED), *newer]

    def on_dropped(self, digest: str, code: Reason) -> list[LearnerAction]:
        """A syncer dropped our accepted delta (its round's merge failed, or it was screened out
        before a certificate): it will not be merged."""
        if self.in_flight is None or self.in_flight.digest != digest:
            return []
        return self._lose(code)

    def on_certified(
        self,
        version: int,
        merged_digests: frozenset[str],
        carry: bool = True,
        pace: int | None = None,
        rejected: frozenset[str] = frozenset(),
    ) -> list[LearnerAction]:
        """Certified ``version`` (the newest of a verified chain) is ready to apply.
        ``merged_digests``: every submission the chain's certificates merged. ``carry=False``
        when those are unknown: a delta in flight is then not carried (it may be merged).
        ``pace``: steps per delta of the run at that version (``round_pace`` of its certificate).
        ``rejected``: the submissions the chain's certificates rejected (screened out); a delta
        in flight that is neither merged nor rejected came too late.
        The inner lr schedule is then put at ``version × pace`` plus the progress this learner
        keeps, so every learner, fast or slow, trains at the run's rate: one counting only its
        own steps would stay at a higher lr than the run's and its deltas would be norm
        outliers (a learner training a third of the time was screened out round after round)."""
        if version <= self.version:
            return []
        fly = self.in_flight
        merged = fly is not None and fly.digest is not None and fly.digest in merged_digests
        carried = 0
        if fly is not None:
            self.merged += merged
            self.lost += not merged
            if not merged and fly.digest not in rejected:
                self._count_late(fly.late or Reason.ROUND_CLOSED)
            # A delta of more than H steps (it already holds carried work), or a folded one, is
            # not carried again: its sent part is dropped, so no delta grows past 2H steps.
            # Under a time budget H bounds nothing: there a delta holding carried work is not
            # carried again (else one screened out, carried, grows and is screened out forever).
            short = fly.steps <= self.inner_steps and fly.overtime == 0
            short = short and (self.time_budget is None or fly.carried == 0)
            # Only a delta no later round can merge: with staleness s, the round after
            # ``version`` still accepts base ``version − s``.
            final = fly.base_version < version - self.staleness
            carry = carry and self.fragments == 1
            carried = fly.steps if carry and not merged and short and final else 0
            self.trained += carried  # its work goes into the next delta
            self.carried += carried
        if pace is not None and pace > 0:
            seek: int | None = version * pace + self.trained
        else:
            seek = version * self.inner_steps if version > self.version + 1 else None
        self.version, self.in_flight = version, None
        # A budget is per round: it restarts when a version lands, so every learner sends about
        # one budget after the round opened and the slow ones meet the same round close.
        self.trained_seconds = 0.0
        return [Rebase(version, fly is not None, merged, seek, carried)]

    def _lose(self, code: Reason) -> list[LearnerAction]:
        self.in_flight = None
        self.lost += 1
        if code in TIMING:
            self._count_late(code)
        return [Drop(code)]

    def _count_late(self, code: Reason) -> None:
        self.late[code] = self.late.get(code, 0) + 1


def round_pace(steps: Iterable[int]) -> int | None:
    """The run's steps per delta at a certified version: the median of the steps its merged
    deltas claim (the lower median, so every learner computes the same integer), None when it
    merged none. With a fixed H it is H; under a time budget, what a typical learner trained."""
    ordered = sorted(steps)
    return ordered[(len(ordered) - 1) // 2] if ordered else None
