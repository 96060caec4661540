"""One island in the simulator: a real ``LearnerMachine`` whose inner steps take simulated time.

Like the trainer thread, it looks at certificates between chunks of steps and never waits on
the network (sending runs beside training). Each delta is delivered by the same machine the
runtime drives (``core.delivery``): its sends go over the world's links (``World.deliver_one``),
its waits onto the event heap, and what it tells the trainer to the learner machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from p2pdiloco.core.delivery import (
    Answer,
    Committee,
    Delivery,
    DeliveryEvent,
    Receipt,
    Settled,
    Tell,
    Timer,
    Verdict,
)
from p2pdiloco.core.delivery import Send as DeliverySend
from p2pdiloco.core.delivery import Wait as DeliveryWait
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
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.sim.network import SimNetwork


class Network(SimNetwork, Protocol):
    """What a learner needs of the simulated network (``sim.world.World`` is it): the clock,
    the peers, the run, the current committee and chain, and where its uploads go."""

    run_id: str
    trained_tokens: int
    deltas_sent: int

    def deliver_one(self, learner: SimLearner, sub: Submission, index: int) -> None: ...
    def catch_up(self, learner: SimLearner) -> None: ...
    def merged_since(self, version: int, newest: int) -> frozenset[str]: ...


@dataclass
class Pending:
    """The delta in flight and its delivery machine (``core.delivery``)."""

    sub: Submission
    machine: Delivery
    accepted_coming: bool = False  # an "accepted" reply is on its way (``World._arrival``)


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
    world: Network
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

    # -- sending: the delivery machine's effects on the event heap ----------------------------

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
        self.pending = Pending(sub, Delivery(sub.digest, peer_id))
        self._feed(self.pending, Committee(w.committee.members), first=True)

    def redeliver(self) -> None:
        """A new view's committee: the delivery machine offers it the delta in flight unless a
        member holds or refused it (an old member that accepted it may never certify)."""
        p = self.pending
        if p is not None and self.alive and self.machine.in_flight is not None:
            self._feed(p, Committee(self.world.committee.members))

    def unreachable(self, digest: str, member: int) -> None:
        p = self.pending
        if self.alive and p is not None and p.sub.digest == digest:
            self._feed(p, Answer(self.world.peers[member].profile.peer_id, "error"))

    def reply(
        self, digest: str, member: int, accepted: bool, code: Reason | None, hint: int | None
    ) -> None:
        p = self.pending
        if not self.alive or p is None or p.sub.digest != digest:
            return
        self.poke()
        status = "accepted" if accepted else "rejected"
        self._feed(p, Answer(self.world.peers[member].profile.peer_id, status, code, hint))

    def dropped(self, digest: str, member: int, code: Reason) -> None:
        """Member ``member`` dropped the delta (the simulator's syncers say so as they drop it,
        where real learners poll their holders' receipts)."""
        p = self.pending
        if not self.alive:
            return
        self.poke()
        if p is not None and p.sub.digest == digest:
            self._feed(p, Receipt(self.world.peers[member].profile.peer_id, True, code))

    def _timer(self, p: Pending) -> None:
        if self.alive and p is self.pending:
            self._feed(p, Timer())

    def _feed(self, p: Pending, event: DeliveryEvent, first: bool = False) -> None:
        """One event to the delta's delivery machine, and its effects carried out. As in the
        runtime, a certificate above the delta's base settles it before anything more is sent
        (the learner knows of one as soon as it is made), but a new delta's ``first`` pass
        always goes out."""
        w = self.world
        for e in p.machine.handle(event, w.clock.now):
            settled = w.version != p.sub.base_version
            if isinstance(e, DeliverySend | DeliveryWait) and settled and not first:
                p.machine.handle(Settled(), w.clock.now)
                return
            if isinstance(e, DeliverySend):
                for peer_id in e.peers:
                    w.deliver_one(self, p.sub, w.by_id[peer_id])
            elif isinstance(e, DeliveryWait):
                w.clock.at(e.until, self._timer, p)
            elif isinstance(e, Tell) and e.verdict is Verdict.ACCEPTED:
                self.machine.on_reply(p.sub.digest, True, None, e.hint)
            elif isinstance(e, Tell) and e.verdict is Verdict.REFUSED:
                self._after(self.machine.on_reply(p.sub.digest, False, e.code, e.hint))
            elif isinstance(e, Tell):
                assert e.code is not None
                self._after(self.machine.on_dropped(p.sub.digest, e.code))
            # Pause (a status line) and PollReceipt (drops are said here, not polled): none

    def _after(self, actions: list[LearnerAction]) -> None:
        for a in actions:
            if isinstance(a, CatchUp):
                self.world.catch_up(self)
