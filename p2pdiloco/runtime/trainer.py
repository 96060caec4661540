"""The training thread: a ``Learner`` driven by the sans-IO ``LearnerMachine``.

It owns the model, the inner optimizer, the error-feedback buffer and the machine, and nothing
network-facing: sealed submissions go out through ``submit`` (the runtime's thread-safe entry)
and everything the runtime learns comes back through ``inbox`` (certified states, replies,
dropped deltas). It never blocks on the network: between chunks of inner steps it only looks
at the inbox. What it shows (counters, losses, phase) is republished as an immutable
``TrainerView`` after each chunk, for the dashboard and the status file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from p2pdiloco.core.learner import (
    CatchUp,
    Drop,
    LearnerAction,
    LearnerMachine,
    LearnerPhase,
    Rebase,
    Send,
    Train,
    Wait,
    round_pace,
)
from p2pdiloco.core.weights import plausible_claim
from p2pdiloco.island.leader import IslandBroken
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.submissions import (
    DATA_LAG,
    FragmentRef,
    SubmissionHeader,
    payload_digest,
    seal_submission,
)
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.sync.fragments import round_fragment, round_names
from p2pdiloco.train.attacks import INFLATED_STEPS
from p2pdiloco.train.learner import Learner, Outgoing, rebase_anchor
from p2pdiloco.train.schedule import past_horizon

log = logging.getLogger(__name__)


# -- messages from the runtime ----------------------------------------------------------------


@dataclass(frozen=True)
class Certified:
    state: CertifiedState
    merged_digests: frozenset[str]
    # False when ``merged_digests`` is not known (moving onto the newest version at stop): a
    # delta in flight is then not carried, since it may be merged and would count twice.
    known: bool = True
    rejected: frozenset[str] = frozenset()  # of ours: submissions its certificates rejected


@dataclass(frozen=True)
class Reply:
    digest: str
    accepted: bool
    code: Reason | None
    fast_forward: int | None


@dataclass(frozen=True)
class Dropped:
    digest: str
    code: Reason


TrainerEvent = Certified | Reply | Dropped


@dataclass(frozen=True)
class Submission:
    """A sealed submission for the runtime to deliver to the committee of ``base_version + 1``."""

    digest: str
    header: bytes
    payload: bytes
    base_version: int


@dataclass(frozen=True)
class TrainerView:
    phase: str = "starting"
    version: int = 0
    inner_step: int = 0  # steps of the current stretch (since the last send), step by step
    stretch_steps: int = 0  # the learner's steps per delta (H/P, or the test's override)
    overtime: int = 0  # of ``inner_step``, steps trained past the stretch with a delta in flight
    # Seconds, at ``published_at`` (monotonic), until this stretch's delta is due (at the
    # measured pace, or the time budget's end); None in overtime, idle, or before a pace.
    due_s: float | None = None
    published_at: float = 0.0
    sent: int = 0
    lost: int = 0
    late: tuple[tuple[str, int], ...] = ()  # of ``lost``, the late ones: (reason code, count)
    tokens_trained: int = 0
    last_loss: float | None = None
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    losses: tuple[float, ...] = ()
    events: tuple[str, ...] = ()
    error: str | None = None
    # Share of wall time spent in inner steps, from the first chunk to the latest one (waits
    # for the network in between count against it; idling after the last version does not).
    utilization: float = 0.0
    train_seconds: float = 0.0  # wall time inside inner steps
    # The longest wall time between two chunks of inner steps (rebases, sends, catch-ups, any
    # wait): how long the step counter ever stood still while the learner had work (the
    # pauses of a compute share below 1 excepted: those the volunteer chose).
    longest_pause_s: float = 0.0
    stretch_s: float = 0.0  # the latest stretch's training time (H/P steps, or the budget)
    # Pause time a compute share below 1 still owes: pauses cut short (a certificate, the
    # budget's end), added to the next ones (``Trainer._pause``). Over the span of
    # ``utilization`` the share holds once these are taken.
    owed_pause_s: float = 0.0


@dataclass
class _Counters:
    tokens_trained: int = 0
    tokens_since_send: int = 0
    last_loss: float | None = None
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    losses: deque[float] = field(default_factory=lambda: deque(maxlen=48))
    events: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    train_seconds: float = 0.0  # wall time inside inner steps
    first_at: float | None = None  # monotonic start of the first chunk
    last_at: float = 0.0  # monotonic end of the latest chunk
    longest_pause_s: float = 0.0

    def utilization(self) -> float:
        span = self.last_at - self.first_at if self.first_at is not None else 0.0
        return min(1.0, self.train_seconds / span) if span > 0 else 0.0


class Trainer:
    def __init__(
        self,
        learner: Learner,
        machine: LearnerMachine,
        state: CertifiedState,
        *,
        identity: Identity,
        run_id: str,
        manifest: RunManifest,
        submit: Callable[[Submission], None],
        catch_up: Callable[[int], None],
        replay: bool = False,
        inflate: bool = False,
        compute_share: float = 1.0,
    ) -> None:
        self.learner = learner
        self.machine = machine
        self.state = state  # the certified version the learner trains from (this thread's copy)
        self.identity = identity
        self.run_id = run_id
        self.manifest = manifest
        self.submit = submit
        self.catch_up = catch_up
        self.replay = replay  # attacker: re-send the first signed submission byte for byte
        self.inflate = inflate  # attacker: claim INFLATED_STEPS steps (and tokens to match)
        self.compute_share = compute_share  # of wall time; the rest pauses between chunks
        self.inbox: queue.Queue[TrainerEvent] = queue.Queue()
        self.view = TrainerView(version=state.version)
        self._c = _Counters()
        self._sent: Outgoing | None = None
        self._first: Submission | None = None
        self._error: str | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by a certificate and by ``stop``: ends a pause
        self._owed_pause = 0.0  # of the compute share, cut short and added to the next pause
        self._thread: threading.Thread | None = None
        self._shapes = {n: tuple(t.shape) for n, t in state.params.items()}
        learner.on_step = self._stepped
        learner.should_stop = self._stop.is_set
        self._chunk_start = 0.0  # monotonic start of the chunk under way
        self._chunk_overtime = False  # the chunk under way trains past the stretch
        self._past_horizon = False  # said once: the lr schedule ended (ADR 0053)
        pace = _pace(state)
        if pace is not None:  # joining mid-run: train at the run's lr, not a fresh warmup's
            self._seek(state.version * pace + machine.trained, state.version)

    # -- lifecycle (called from the main thread) ---------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, daemon=True, name="trainer")
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop after the current inner step (an island's: after its chunk); the delta in
        flight is abandoned, and a stretch that was due is not sent: its steps stay in the
        local progress, which the next start sends."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def settle(self, newest: CertifiedState | None) -> None:
        """After ``stop``, on the caller's thread: apply what is still in the inbox and move onto
        ``newest`` (the runtime's current version) if it is newer, so the local progress saved
        next to the certified state is based on that very version."""
        assert not self.alive
        self._drain()
        if newest is not None and newest.version > self.state.version:
            self.deliver(Certified(newest, frozenset(), known=False))
            self._drain()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def deliver(self, event: TrainerEvent) -> None:
        """Thread-safe: the runtime hands an event to the training thread."""
        self.inbox.put(event)
        if isinstance(event, Certified):  # rebased onto at once: a pause ends for it
            self._wake.set()

    # -- the loop ------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._drain()
                    for action in self.machine.next_action(time.monotonic()):
                        self._do(action)
                except IslandBroken as e:
                    self._reform(e)
                self._publish()
        except Exception as e:  # reported on the dashboard and in the status file
            log.exception("training loop stopped")
            self._error = f"{type(e).__name__}: {e}"
            self._publish("failed")

    def _drain(self, wait: float = 0.0) -> None:
        """Apply every event that arrived; wait up to ``wait`` seconds for a first one."""
        try:
            events = [self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()]
        except queue.Empty:
            return
        with contextlib.suppress(queue.Empty):
            while True:
                events.append(self.inbox.get_nowait())
        for ev in events:
            if isinstance(ev, Certified):
                actions = self.machine.on_certified(
                    ev.state.version,
                    ev.merged_digests,
                    carry=ev.known,
                    pace=_pace(ev.state),
                    rejected=ev.rejected,
                )
                if actions:
                    self._new_state = ev.state
            elif isinstance(ev, Reply):
                actions = self.machine.on_reply(ev.digest, ev.accepted, ev.code, ev.fast_forward)
            else:
                actions = self.machine.on_dropped(ev.digest, ev.code)
            for a in actions:
                self._do(a)

    def _do(self, action: LearnerAction) -> None:
        if isinstance(action, (Train, Send)) and self._stop.is_set():
            return  # stopping: the rest of this step's actions keep learner and machine in step
        if isinstance(action, Train):
            self._train(action.steps)
            overtime = self.machine.phase is LearnerPhase.OVERTIME
            if overtime and self._sent and self.learner.stretch_norm is None:
                # the stretch after our delta in flight is done: its norm is what the next
                # delta, holding this overtime too, is folded to (ADR 0019)
                self.learner.measure_stretch(self._sent)
        elif isinstance(action, Send):
            self._send(action.overtime, action.carried)
        elif isinstance(action, Wait):
            self._publish()
            self._drain(wait=action.seconds)
        elif isinstance(action, Rebase):
            new, sent = self._new_state, self._sent
            carry = action.carried > 0 and sent is not None
            if action.anchor_sent and not action.merged and sent is not None:
                self.learner.unsend(sent)  # the certificate did not merge it
            if carry:  # ... and its work goes into the next delta: anchor at the old base
                assert sent is not None
                self.learner.carry(sent, self.state.params)
                self._c.tokens_since_send += sent.tokens
            anchor = sent if action.anchor_sent and not carry else None
            self.learner.rebase(new.params, self.state.params, anchor)
            if action.seek_step is not None:  # follow the run's lr schedule, not our own count
                self._seek(action.seek_step, new.version)
            self.state, self._sent = new, None
            self._event(f"rebased onto version {new.version}")
        elif isinstance(action, Drop):
            if self._sent is not None:  # the sent part is dropped, later progress kept
                self.learner.unsend(self._sent)
                self.learner.rebase(self.state.params, self.state.params, self._sent)
                self._sent = None
            self._event(f"delta on version {self.state.version} not merged ({action.code})")
        elif isinstance(action, CatchUp):
            self.catch_up(action.version)

    _new_state: CertifiedState

    def _reform(self, e: IslandBroken) -> None:
        """A member of this learner's island stopped: the survivors re-form and go on from the
        last certified version (or, with a delta in flight, from the parameters that delta was
        taken from, so rebasing stays exact); the broken stretch's steps are gone."""
        if self.machine.version > self.state.version:  # broken while rebasing onto it
            self.state, self._sent = self._new_state, None
        size = self.learner.reform(rebase_anchor(self.state.params, self._sent))
        self.machine.on_progress_lost()
        self._c.tokens_since_send = 0
        self._event(f"{e}; island re-formed with {size} ranks on version {self.state.version}")

    def _train(self, steps: int) -> None:
        c = self._c
        start = time.monotonic()
        if c.first_at is not None:
            c.longest_pause_s = max(c.longest_pause_s, start - c.last_at)
        c.first_at = start if c.first_at is None else c.first_at
        self._chunk_start = start
        self._chunk_overtime = self.machine.phase is LearnerPhase.OVERTIME
        # With work scoring the rows are those assigned for the version the next delta will be
        # based on (ADR 0062): with a delta in flight on v, the next one goes out on v + 1 once
        # v + 1 is certified, usually at once (its steps trained through the round). Rows of
        # v there made every such delta show no advantage on its own data (real networks
        # refused about half the honest deltas).
        ahead = 1 if self._sent is not None else 0
        st = self.learner.train(steps, self.state.version + ahead)
        c.last_at = time.monotonic()
        busy = c.last_at - start
        c.train_seconds += busy
        seconds = busy
        if self.compute_share < 1.0:  # leave the machine usable: pause
            seconds = self._pause(busy, start)
            # A pause the volunteer asked for is not the learner standing still: the longest
            # pause counts only waits between chunks beyond it (the network must cause none).
            c.last_at = time.monotonic()
        # The round's time budget counts wall time, pauses included: a node that trains a
        # third of the time is paced like hardware three times slower.
        self.machine.on_trained(st.steps, seconds)
        c.tokens_trained += st.tokens
        c.tokens_since_send += st.tokens
        c.last_loss = st.loss_last
        c.losses.append(st.loss_last)
        per_step = st.seconds / max(1, st.steps)
        c.step_seconds = per_step if c.step_seconds == 0 else 0.7 * c.step_seconds + 0.3 * per_step
        c.tokens_per_second = st.tokens / st.seconds if st.seconds > 0 else 0.0

    def _pause(self, busy: float, start: float) -> float:
        """Pause for the compute share after a chunk that trained ``busy`` seconds; returns the
        chunk's wall time to count against the budget. The pause never delays the learner:
        it ends at the end of the budget, so the delta goes out on time, and when the runtime
        hands over a certificate, so it is rebased onto at once (a slow learner paused through
        both, rebased up to 2.3 s after the others and missed the round's close under CI load).
        What is cut short is added to the next pause, so the share holds over time (up to four
        chunks' pauses owed: a budget shorter than one chunk and its pause cannot hold it)."""
        own = busy * (1.0 / self.compute_share - 1.0)
        pause = own + self._owed_pause
        left = self.machine.budget_left
        cap = pause if left is None else min(pause, max(0.0, left - busy))
        self._wake.clear()
        with self.inbox.mutex:
            certified = any(isinstance(e, Certified) for e in self.inbox.queue)
        if not certified and not self._stop.is_set():
            self._wake.wait(cap)
        paused = time.monotonic() - start - busy
        self._owed_pause = min(4 * own, max(0.0, pause - paused))
        seconds = time.monotonic() - start
        if left is not None and cap < pause and paused >= cap - 1e-3:  # budget spent: send
            seconds = max(seconds, left)
        return seconds

    def _send(self, overtime: int = 0, carried: int = 0) -> None:
        c = self._c
        loss = c.last_loss if c.last_loss is not None else 0.0
        inner = self.manifest.inner
        tokens = c.tokens_since_send or self.learner.steps_since_send * inner.batch_size * (
            inner.seq_len
        )
        fragments = self.manifest.outer.fragments
        if fragments > 1:
            # A fragment's delta holds the H steps since that fragment was last synced, plus any
            # overtime: it is not folded, and nothing is carried into it (ADR 0032).
            overtime = carried = 0
        names = round_names(self._shapes, fragments, self.state.version)
        out = self.learner.outgoing(
            self.state.version, self.state.params, tokens, loss, overtime, carried, names
        )
        if out.fold < 1.0:
            self._event(
                f"delta of {out.steps} steps ({overtime} while the last was undecided, "
                f"{carried} carried) folded to one stretch's norm (x{out.fold:.2f})"
            )
        sub = self._seal(out)
        if self.replay and self._first is not None:
            sub = self._first
        self._first = self._first or sub
        self._sent, c.tokens_since_send = out, 0
        self.machine.on_sent(sub.digest)
        self.submit(sub)
        grown = self.learner.after_send(out)
        if grown is not None:
            self._event(f"island now {grown} ranks: members joined at the send boundary")

    def _seal(self, out: Outgoing) -> Submission:
        # A delta holding carried work may span up to 2H steps; it claims at most one delta's
        # worth (H), as every syncer would clip it (ADR 0010), so an honest claim is never cut.
        H = self.manifest.inner_steps
        steps, tokens = plausible_claim(max(1, out.steps), max(1, out.tokens), H)
        if self.inflate:
            inner = self.manifest.inner
            steps, tokens = INFLATED_STEPS, INFLATED_STEPS * inner.batch_size * inner.seq_len
        header = SubmissionHeader(
            peer_id=self.identity.peer_id,
            base_version=out.base_version,
            steps=steps,
            tokens=tokens,
            loss=min(max(out.loss, 0.0), 1e4),
            codec=self.manifest.compression,
            data_version=_named_rows(out) if self.manifest.rules.work is not None else None,
            fragments=[
                FragmentRef(
                    index=round_fragment(out.base_version, self.manifest.outer.fragments),
                    digest=payload_digest(out.payload),
                    nbytes=len(out.payload),
                )
            ],
        )
        raw = seal_submission(self.identity, self.run_id, header)
        return Submission(hashlib.sha256(raw).hexdigest(), raw, out.payload, out.base_version)

    def _seek(self, step: int, version: int) -> None:
        """Put the inner lr schedule at the run's global ``step`` (at certified ``version``); the
        first time that is past the run's horizon, say so once in the log and the events."""
        self.learner.seek(step)
        cfg = self.learner.cfg
        if not self._past_horizon and past_horizon(step, cfg.total_steps):
            self._past_horizon = True
            self._event(
                f"version {version}: past the run's planned lr schedule ({cfg.total_steps} inner "
                f"steps); the inner lr stays at {cfg.min_lr_ratio:g} × its peak from here on"
            )

    def _event(self, text: str) -> None:
        log.info(text)
        self._c.events.append(f"{time.strftime('%H:%M:%S')} {text}")

    def _stepped(self, done: int) -> None:
        """After each inner step of a chunk (training thread): the progress, republished, so the
        dashboard's count moves step by step and not only between chunks (a chunk may be a
        whole stretch)."""
        m, now = self.machine, time.monotonic()
        chunk_s = now - self._chunk_start
        per_step = chunk_s / done
        view = self.view
        if self._c.first_at == self._chunk_start:  # the first chunk: nothing published yet
            # It is a whole stretch (an hour on a 12B model) that read "connecting", 0 tok/s,
            # compute 0 % until it ended: the machine's phase, this chunk's own rate (one
            # process: batch × (seq − 1) tokens a step, as ``train_steps`` counts them) and
            # all of its time in inner steps.
            inner = self.manifest.inner
            rate = done * inner.batch_size * (inner.seq_len - 1) / chunk_s if chunk_s > 0 else 0.0
            view = replace(
                view,
                phase=m.phase.value,
                tokens_per_second=rate,
                utilization=1.0,
                train_seconds=chunk_s,
            )
        self.view = replace(
            view,
            inner_step=m.trained + done,
            overtime=m.overtime + (done if self._chunk_overtime else 0),
            due_s=None
            if self._chunk_overtime
            else self._due(m.trained + done, now - self._chunk_start, per_step),
            published_at=now,
        )

    def _due(self, trained: int, chunk_s: float, per_step: float) -> float | None:
        """Seconds until the stretch under way is due to be sent, ``chunk_s`` into a chunk that
        trains at ``per_step`` seconds a step; None in overtime or idle, or with no pace yet."""
        m = self.machine
        if m.phase in (LearnerPhase.OVERTIME, LearnerPhase.IDLE) or m.trained >= m.inner_steps:
            return None
        if m.time_budget is not None:  # wall time, pauses included (``_train``)
            return max(0.0, m.time_budget - m.trained_seconds - chunk_s)
        pace = self._c.step_seconds or per_step
        if pace <= 0:
            return None
        return max(0, m.inner_steps - trained) * pace / self.compute_share

    def _publish(self, phase: str | None = None) -> None:
        c, m = self._c, self.machine
        phase = phase or m.phase.value
        # The speed of the last chunk while the learner works; a node that stopped training
        # (target version reached, or failed) announces none in its heartbeat.
        training = phase not in ("failed", LearnerPhase.IDLE.value)
        self.view = TrainerView(
            phase=phase,
            version=self.state.version,
            inner_step=m.trained,
            stretch_steps=m.inner_steps,
            overtime=m.overtime,
            due_s=None if phase == "failed" else self._due(m.trained, 0.0, 0.0),
            published_at=time.monotonic(),
            sent=m.sent,
            lost=m.lost,
            late=tuple(sorted((code.value, n) for code, n in m.late.items())),
            tokens_trained=c.tokens_trained,
            last_loss=c.last_loss,
            step_seconds=c.step_seconds,
            tokens_per_second=c.tokens_per_second if training else 0.0,
            losses=tuple(c.losses),
            events=tuple(c.events),
            error=self._error,
            utilization=c.utilization(),
            train_seconds=c.train_seconds,
            longest_pause_s=c.longest_pause_s,
            owed_pause_s=self._owed_pause,
            stretch_s=c.step_seconds * m.inner_steps
            if self.manifest.time_budget is None
            else float(self.manifest.time_budget),
        )


def _pace(state: CertifiedState) -> int | None:
    """The run's steps per delta at ``state`` (None at genesis, or when it merged nothing)."""
    cert = state.cert
    return round_pace(a.steps for a in cert.body.accepted) if cert is not None else None


def _named_rows(out: Outgoing) -> int | None:
    """The rows version a delta's header names (ADR 0066): the stretch's, within the window a
    header may name. Certificates that landed after the stretch's last chunk can push its base
    past the window; the delta is then named by the window's oldest version (and will likely
    show no work there) rather than sealed into a header every syncer refuses."""
    if out.data_version is None:
        return None
    return min(max(out.data_version, out.base_version - DATA_LAG), out.base_version + 1)
