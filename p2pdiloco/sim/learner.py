"""One island in the simulator: a real ``LearnerMachine`` whose inner steps take simulated time.

Like the trainer thread, it looks at certificates between chunks of steps, never waits on the
network (sending runs beside training), and sends each delta to one member of the committee it
knows (``runtime.delivery``: the first of the delta's order), which relays it to the others;
to the next member when one is down, again to one that answers "later" (retryable codes),
telling the machine once: as soon as one syncer accepts, or once one refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from p2pdiloco.core.learner import (
    CatchUp,
    LearnerAction,
    LearnerMachine,
    LearnerPhase,
    Send,
    Train,
    Wait,
)
from p2pdiloco.core.round import Submission
from p2pdiloco.protocol.reasons import RETRYABLE, Reason

if TYPE_CHECKING:
    from p2pdiloco.sim.world import World

RETRY = 1.0  # seconds before a retryable refusal is sent again
MAX_TRIES = 20


@dataclass
class Pending:
    sub: Submission
    asked: set[int] = field(default_factory=set)  # member indices sent to
    answers: dict[int, bool] = field(default_factory=dict)  # member index → accepted
    accepted_coming: bool = False  # an "accepted" reply is on its way
    codes: list[Reason] = field(default_factory=list)
    hint: int | None = None
    told: bool = False
    tries: dict[int, int] = field(default_factory=dict)
    unreachable: set[int] = field(default_factory=set)  # asked, but down when it arrived
    # Asked, answered BUSY (ADR 0046), the one that answered longest ago first.
    busy: dict[int, None] = field(default_factory=dict)


@dataclass
class Overtime:
    """Chunks of ``steps`` inner steps, ``seconds`` each, back to back from ``start``: what a
    learner trains while its delta is in flight and its stretch is done. The machine does the
    same thing at every boundary until a certificate, a reply or its give-up time changes
    something, so the simulator wakes it only then (``SimLearner.poke``) and replays the
    boundaries passed meanwhile, instead of an event per chunk (a quarter of the time budget:
    a step a chunk with budgets of a few seconds, most of a 10,000-peer run's events)."""

    start: float
    steps: int
    seconds: float
    done: int = 0  # chunks replayed
    wake: int = 0  # the boundary a wake is scheduled for (0: none)


@dataclass
class SimLearner:
    world: World
    index: int
    machine: LearnerMachine
    epoch: int
    pending: Pending | None = None
    certs: list[int] = field(default_factory=list)  # versions arrived, applied between chunks
    deltas: int = 0
    overtime: Overtime | None = None
    # Overtime without an event a chunk (``Overtime``); off, every chunk is an event, as
    # ``tests/test_sim.py`` compares.
    replay_overtime: ClassVar[bool] = True

    @property
    def alive(self) -> bool:
        peer = self.world.peers[self.index]
        return peer.up and peer.epoch == self.epoch

    @property
    def step_seconds(self) -> float:
        return self.world.peers[self.index].profile.step_seconds

    def go(self) -> None:
        """Carry out what the machine says until it trains (a timed event) or waits."""
        w = self.world
        for _ in range(16):
            for a in self.machine.next_action(w.clock.now):
                if isinstance(a, Train):
                    dur = a.steps * self.step_seconds
                    overtime = self.machine.phase is LearnerPhase.OVERTIME
                    if overtime and self.replay_overtime and not self.certs:
                        self._sleep(a.steps, dur)
                    else:
                        w.clock.after(dur, self._trained, a.steps, dur)
                    return
                if isinstance(a, Send):
                    self._send(a)
                elif isinstance(a, Wait):
                    w.clock.after(a.seconds, self._resume)
                    return
        raise RuntimeError("learner machine neither trains nor waits")  # a machine bug

    # -- overtime, replayed ------------------------------------------------------------------

    def _sleep(self, steps: int, seconds: float) -> None:
        """Train chunks in overtime with no event until something changes (``Overtime``), and
        wake at the last boundary before the machine's give-up time at the latest."""
        self.overtime = ot = Overtime(self.world.clock.now, steps, seconds)
        fly = self.machine.in_flight
        assert fly is not None
        due = fly.sent_at + self.machine.give_up_after - ot.start
        self._wake_at(max(1, math.floor(due / seconds)))

    def _wake_at(self, boundary: int) -> None:
        ot = self.overtime
        assert ot is not None
        if ot.wake and ot.wake <= boundary:
            return
        ot.wake = boundary
        self.world.clock.at(ot.start + boundary * ot.seconds, self._woken, ot, boundary)

    def poke(self) -> None:
        """Something reaches the learner now (a certificate, a reply): the chunks finished
        before it are replayed first, and the learner wakes when the chunk under way ends, as
        it would have looked then."""
        if self.overtime is None or not self.alive:
            return
        self._replay(self.world.clock.now)
        ot = self.overtime
        self._wake_at(ot.done + 1)

    def _replay(self, until: float) -> None:
        """The boundaries up to ``until`` passed with nothing new: their chunks are trained (one
        ``on_trained`` for them all: the same counts and pace) and the machine asked again,
        which says to train on (a chunk of another size when its pace estimate moved: the
        chunks then go on from there)."""
        ot, w = self.overtime, self.world
        assert ot is not None
        while (passed := int((until - ot.start) / ot.seconds + 1e-9) - ot.done) > 0:
            ot.done += passed
            self.machine.on_trained(passed * ot.steps, passed * ot.seconds)
            w.trained_tokens += passed * ot.steps * w.cfg.tokens_per_step
            again = self.machine.next_action(end := ot.start + ot.done * ot.seconds)
            if again == [Train(ot.steps)]:
                return
            assert len(again) == 1 and isinstance(again[0], Train), again  # still overtime
            steps = again[0].steps
            self.overtime = ot = Overtime(end, steps, steps * self.step_seconds)

    def _woken(self, ot: Overtime, boundary: int) -> None:
        if ot is not self.overtime or ot.wake != boundary or not self.alive:
            return
        ot.wake = 0
        self._replay(self.world.clock.now - 0.5 * ot.seconds)  # the chunks before this one
        if self.overtime is not ot:  # they changed size: wake at the new chunk's end
            self._wake_at(self.overtime.done + 1)  # type: ignore[union-attr]
            return
        self.overtime = None
        self._trained(ot.steps, ot.seconds)

    def cert_arrived(self, version: int) -> None:
        self.poke()
        self.certs.append(version)

    def _resume(self) -> None:
        if self.alive:
            self._apply_certs()
            self.go()

    def _trained(self, steps: int, seconds: float) -> None:
        if not self.alive:
            return
        self.machine.on_trained(steps, seconds)
        self.world.trained_tokens += steps * self.world.cfg.tokens_per_step
        self._apply_certs()
        self.go()

    def _apply_certs(self) -> None:
        if not self.certs:
            return
        newest, self.certs = max(self.certs), []
        merged = self.world.merged_since(self.machine.version, newest)
        self.machine.on_certified(newest, merged)
        self.pending = None

    # -- sending ---------------------------------------------------------------------------

    def _send(self, send: Send) -> None:
        w = self.world
        self.deltas += 1
        w.deltas_sent += 1
        peer_id = w.peers[self.index].profile.peer_id
        tokens = send.steps * w.cfg.tokens_per_step
        sub = Submission(peer_id, w.run_id, send.base_version, send.steps, tokens, "")
        sub = w.merge.seal(self.index, sub, w.deltas_sent, w.clock.now)
        self.machine.on_sent(sub.digest)
        w.subs[sub.digest] = sub
        self.pending = Pending(sub)
        w.deliver(self, sub, self.pending)

    def redeliver(self) -> None:
        """A new view's committee: send the delta in flight to one of its members unless one
        holds it (an old member that accepted it may never certify), as the runtime's poller
        does."""
        p = self.pending
        if p is not None and self.alive and self.machine.in_flight is not None:
            self.world.deliver(self, p.sub, p)

    def unreachable(self, digest: str, member: int) -> None:
        """A member was down: the next one at once, or this one again later if none is left."""
        p, w = self.pending, self.world
        if not self.alive or p is None or p.sub.digest != digest:
            return
        p.unreachable.add(member)
        asked = len(p.asked)
        w.deliver(self, p.sub, p)
        tries = p.tries.get(member, 0)
        if len(p.asked) == asked and tries < MAX_TRIES and w.version == p.sub.base_version:
            p.tries[member] = tries + 1
            p.unreachable.discard(member)
            w.clock.after(RETRY, w.deliver_one, self, p.sub, member)

    def reply(self, digest: str, member: int, accepted: bool, code: Reason | None,
              hint: int | None) -> None:  # fmt: skip
        p, w = self.pending, self.world
        if not self.alive or p is None or p.sub.digest != digest:
            return
        self.poke()
        if not accepted and code is Reason.BUSY:  # the next member at once (ADR 0046)
            p.busy.pop(member, None)
            p.busy[member] = None
            asked = len(p.asked)
            w.deliver(self, p.sub, p)
            if len(p.asked) > asked:
                return
        if not accepted and code in RETRYABLE:
            tries = p.tries.get(member, 0)
            # Every member busy: at most MAX_TRIES asks in all, as the runtime's delivery passes
            spent = sum(p.tries.values()) if code is Reason.BUSY else tries
            if spent < MAX_TRIES and w.version == p.sub.base_version:
                # Every member busy: the one asked longest ago, as ``next_targets`` says.
                again = next(iter(p.busy)) if code is Reason.BUSY else member
                p.tries[again] = p.tries.get(again, 0) + 1
                w.clock.after(RETRY, w.deliver_one, self, p.sub, again)
            return
        p.answers[member] = accepted
        p.unreachable.discard(member)
        p.busy.pop(member, None)
        if not accepted:
            p.codes.append(code or Reason.MALFORMED)
            p.hint = hint if hint is not None else p.hint
        if p.told:
            return
        if accepted:
            p.told = True
            self.machine.on_reply(digest, True, None, None)
        elif len(p.answers) + len(p.unreachable) >= len(p.asked) and not any(p.answers.values()):
            p.told = True
            self._after(self.machine.on_reply(digest, False, p.codes[0], p.hint))

    def dropped(self, digest: str, code: Reason) -> None:
        if self.alive:
            self.poke()
            self._after(self.machine.on_dropped(digest, code))

    def _after(self, actions: list[LearnerAction]) -> None:
        for a in actions:
            if isinstance(a, CatchUp):
                self.world.catch_up(self)
