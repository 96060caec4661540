"""One learner in the network: inner steps, its outer delta, and rebasing onto a new version.

The learner never owns the global state: it starts from a certified version θ_v, trains, sends
Δ = θ_v − θ_local, and keeps training while that delta is in flight. When version v+1 is
certified it rebases instead of restarting:

    sent      θ_local ← θ_{v+1} + (θ_local − θ_sent)   keep what was trained since sending;
                                                         the sent delta is in θ_{v+1}, or was
                                                         refused and is dropped (carrying a
                                                         refused delta forward would make every
                                                         later one an outlier too), and
                                                         its error-feedback residual is put
                                                         back to what it was before it
    not sent  θ_local ← θ_{new} + (θ_local − θ_v)       a newer version arrived mid-stretch:
                                                         carry all local progress onto it

With Streaming DiLoCo fragments (``sync.fragments``, ADR 0032) a delta covers only the
round's fragment: θ_sent holds that fragment, and the rebase anchors every other tensor at the
old base, so the progress of the fragments not sent stays in θ_local for their own rounds.

The inner learning-rate schedule follows global progress (version × the run's steps per
delta, ``round_pace`` of the certificate: H, or under a time budget what a typical learner
trained), not this learner's own step count, so a late joiner or a slow learner trains at the
run's current rate and its deltas have the size of everyone else's (a fresh warmup, or a slow
learner's lagging schedule, would make them outliers).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from p2pdiloco.compress import ErrorFeedback, get_codec
from p2pdiloco.compress.wire import pack_deltas
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.submissions import DATA_LAG
from p2pdiloco.train.attacks import AttackConfig, Attacker
from p2pdiloco.train.data import PackedCorpus, assigned_rows, learner_batches
from p2pdiloco.train.inner import (
    InnerConfig,
    InnerStats,
    make_inner_optimizer,
    seek_schedule,
    train_steps,
)
from p2pdiloco.train.models import build_for_loading, param_state


def inner_config(manifest: RunManifest) -> InnerConfig:
    """The run's inner hyperparameters (``InnerParams`` mirrors ``InnerConfig`` field by field)."""
    return InnerConfig(**manifest.inner.model_dump())


def data_seed(run_seed: int, peer_id: str) -> int:
    """Each learner walks its own permutation of the whole corpus (no coordination needed);
    with work scoring, at the position of the certified version it trains from (ADR 0062)."""
    digest = hashlib.sha256(f"p2pdiloco/data/{run_seed}/{peer_id}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


@dataclass
class Outgoing:
    """A delta ready to send, and what rebasing needs once the round is decided."""

    base_version: int
    payload: bytes
    steps: int
    tokens: int
    loss: float
    sent_params: dict[str, torch.Tensor]  # θ_local when the delta was taken (its fragment)
    # The error-feedback residual before this delta was compressed (the same tensors, not
    # copies: compress replaces residuals): restored if the delta is not merged.
    residual_before: dict[str, torch.Tensor] = field(default_factory=dict)
    fold: float = 1.0  # the scale a delta folding overtime was sent at (1: not folded)
    # With work scoring: the version whose assigned rows the delta trained on (ADR 0066).
    data_version: int | None = None


class Learner:
    """Model, inner optimizer, error feedback and data position of one node."""

    def __init__(
        self,
        manifest: RunManifest,
        corpus: PackedCorpus,
        peer_id: str,
        base_params: Mapping[str, torch.Tensor],
        *,
        device: torch.device,
        attack: AttackConfig | None = None,
        rounds_done: int = 0,
        base_version: int = 0,
        micro_batch: int | None = None,
        num_learners: int = 4,
    ) -> None:
        """``attack`` makes this node an attacker (tests, demo); ``num_learners`` is the round
        size its attack assumes (ALIE's shift). ``micro_batch`` splits the run's step batch."""
        self.manifest = manifest
        self.cfg = inner_config(manifest)
        # Called with the steps done after each inner step of ``train`` (one process only: an
        # island's ranks train elsewhere and report per chunk).
        self.on_step: Callable[[int], None] | None = None
        # Asked after each inner step of ``train`` (one process only, as ``on_step``): once
        # true, the chunk ends there (a node stopping does not finish it).
        self.should_stop: Callable[[], bool] | None = None
        if micro_batch is not None and self.cfg.batch_size % micro_batch == 0:
            # Same step batch as everyone (the run's), split to fit this device's memory.
            self.cfg = replace(self.cfg, grad_accum=self.cfg.batch_size // micro_batch)
        self.corpus = corpus
        self.seed = data_seed(manifest.seed, peer_id)
        self.device = device
        self._setup(base_params, base_version * manifest.inner_steps)
        self.codec = get_codec(manifest.compression)
        self.feedback = ErrorFeedback(self.codec)
        self.attack = attack
        # A lone attacker: it knows only its own deltas. Replay is done at the submission level
        # (re-sending an old signed submission), so it does not transform deltas here.
        self.attacker = (
            Attacker(attack, num_learners=max(1, num_learners), num_attackers=1)
            if attack is not None and attack.kind != "replay"
            else None
        )
        self.rounds_done = rounds_done  # stretches of H steps trained: the data position
        # With work scoring (ADR 0062) the data position is the certified version trained from
        # and the steps trained from it so far: the rows the committee scores a delta on.
        self.data_at = (-1, 0)
        self.steps_since_send = 0
        # L2 norm of the stretch trained right after the delta in flight was sent, taken when
        # that stretch ended (``measure_stretch``): what a delta folding overtime is scaled
        # down to (``outgoing``, ADR 0019).
        self.stretch_norm: float | None = None

    def _setup(self, base_params: Mapping[str, torch.Tensor], global_step: int) -> None:
        """The model at ``base_params``, its inner optimizer, the schedule at ``global_step``."""
        self.model = build_for_loading(self.manifest.model, device=self.device)
        self.load(base_params)
        self.optimizer, self.scheduler = make_inner_optimizer(self.model, self.cfg)
        self.seek(global_step)

    def seek(self, global_step: int) -> None:
        """Put the inner lr schedule at ``global_step`` (after joining or catching up)."""
        seek_schedule(self.optimizer, self.scheduler, global_step)

    def params(self) -> dict[str, torch.Tensor]:
        return param_state(self.model)

    @torch.no_grad()
    def load(self, params: Mapping[str, torch.Tensor]) -> None:
        for n, p in self.params().items():
            p.copy_(params[n].to(p.device, p.dtype))

    def optimizer_state(self) -> dict | None:
        """The inner optimizer's state to save with local progress; None if it cannot be
        restored by a later start (an island's moments are sharded over its ranks)."""
        return self.optimizer.state_dict()

    def train(self, steps: int, version: int | None = None) -> InnerStats:
        """``steps`` inner steps on the next rows of this learner's data (fewer once
        ``should_stop`` says so: the stats count those trained): with work scoring and the
        certified ``version`` trained from, the rows assigned to it for that version
        (``train.data.assigned_rows``; past H steps they are read again). A stretch keeps the
        rows it started on through rebases (ADR 0066: rounds that close while it trains would
        otherwise leave each delta scored on rows it barely saw), until they are ``DATA_LAG``
        versions old; the delta names them (``Outgoing.data_version``)."""
        if self.manifest.rules.work is not None and version is not None:
            batches = self._assigned(steps, version)
        else:
            batches = learner_batches(
                self.corpus,
                seed=self.seed,
                learner=0,
                num_learners=1,
                round=self.rounds_done,
                steps=steps,
                batch_size=self.cfg.batch_size,
            )
        self.rounds_done += 1
        st = self._train_batches(batches)
        self.steps_since_send += st.steps
        if st.steps < steps and self.manifest.rules.work is not None and version is not None:
            at, done = self.data_at  # stopped early: the rows not trained come next
            self.data_at = (at, done - (steps - st.steps))
        return st

    def _assigned(self, steps: int, version: int) -> torch.Tensor:
        """The next ``steps`` batches [T, B, S] of the stretch's rows: those assigned for
        ``version`` at a stretch's first step, or once the stretch's are too old to name."""
        h = self.manifest.inner_steps
        at, start = self.data_at
        stale = version - at >= DATA_LAG or at > version + 1
        if at < 0 or (self.steps_since_send == 0 and at != version) or stale:
            at, start = version, 0
        self.data_at = (at, start + steps)
        version = at
        rows_N, _ = assigned_rows(
            self.corpus.num_train_rows,
            seed=self.seed,
            version=version,
            steps=h,
            batch_size=self.cfg.batch_size,
        )
        rows_HB = rows_N.reshape(h, self.cfg.batch_size)
        picked = torch.arange(start, start + steps) % h
        return self.corpus.train_NS[rows_HB[picked]]

    def _train_batches(self, batches: torch.Tensor) -> InnerStats:
        return train_steps(
            self.model,
            self.optimizer,
            self.scheduler,
            batches,
            grad_accum=self.cfg.grad_accum,
            grad_clip=self.cfg.grad_clip,
            on_step=self.on_step,
            stop=self.should_stop,
        )

    @torch.no_grad()
    def outgoing(
        self,
        base_version: int,
        base: Mapping[str, torch.Tensor],
        tokens: int,
        loss: float,
        overtime: int = 0,
        carried: int = 0,
        names: Iterable[str] | None = None,
    ) -> Outgoing:
        """Δ = θ_base − θ_local over ``names`` (the round's fragment; None: every tensor),
        transformed if this node plays an attacker, compressed.

        ``overtime``: steps of Δ trained while the previous delta was undecided; ``carried``:
        steps of an earlier delta that no certificate merged (``carry``). Δ then spans more
        than one stretch, and is folded: scaled down to the norm of one plain stretch (the one
        after the delta in flight, ``measure_stretch``, or the carried one, ``carry``;
        unmeasured, to the share of its steps that were neither), so the norm screen sees every
        delta at one stretch's scale, at the learning rate of now (ADRs 0019, 0026).
        """
        every = self.params()
        names = sorted(every if names is None else names)
        local = {n: every[n].detach().float().cpu() for n in names}
        delta = {n: base[n].float() - local[n] for n in names}
        steps = self.steps_since_send
        fold, ref = 1.0, self.stretch_norm
        if (overtime > 0 or carried > 0) and steps > 0:
            norm = _l2(delta.values())  # only a delta that folds pays this pass
            share = max(0.0, min(1.0, (steps - overtime - carried) / steps))
            if ref is not None and norm > 0:
                fold = min(1.0, ref / norm)
            else:  # unmeasured: the plain share (none at all: nothing to scale to, sent as is)
                fold = share if share > 0 else 1.0
            delta = {n: d * fold for n, d in delta.items()}
        if self.attacker is not None:
            delta = self.attacker.transform(delta, None, base_version)
        before = dict(self.feedback.residual)
        encoded = {n: self.feedback.compress(n, delta[n]) for n in names}
        out = Outgoing(
            base_version=base_version,
            payload=pack_deltas(encoded),
            steps=steps,
            tokens=tokens,
            loss=loss,
            sent_params={n: t.clone() for n, t in local.items()},
            residual_before=before,
            fold=fold,
            data_version=self.data_at[0] if self.data_at[0] >= 0 else None,
        )
        self.steps_since_send, self.stretch_norm = 0, None
        return out

    @torch.no_grad()
    def measure_stretch(self, sent: Outgoing) -> float:
        """The stretch after ``sent`` is done and that delta is still undecided: keep the norm
        of what was trained since it, ‖θ_sent − θ_local‖, for the fold of the next delta."""
        now = self.params()
        moved = (t - now[n].detach().float().cpu() for n, t in sent.sent_params.items())
        self.stretch_norm = _l2(moved)
        return self.stretch_norm

    def reform(self, state: Mapping[str, torch.Tensor]) -> int:
        """Only an island re-forms (``IslandLearner``); one process never breaks apart."""
        raise NotImplementedError("a single-process learner has no island to re-form")

    def after_send(self, sent: Outgoing) -> int | None:
        """Hook for an island to take in new members at a send boundary; None: no change."""
        return None

    def close(self) -> None:
        """Release what the learner holds beyond this process (an island's members)."""

    def unsend(self, sent: Outgoing) -> None:
        """``sent`` will not be merged: its error-feedback residual goes back to what it was
        before that delta, so the next delta carries no part of work that was thrown away."""
        self.feedback.residual = dict(sent.residual_before)

    @torch.no_grad()
    def carry(self, sent: Outgoing, old_base: Mapping[str, torch.Tensor]) -> None:
        """``sent`` was not merged and its work stays in the parameters for the next delta
        (rebase anchored at ``old_base``, its base): its steps count again toward the next
        delta, and unless a stretch was measured since, its norm (one plain stretch: only
        those are carried) is what that delta is folded to (ADR 0026)."""
        self.steps_since_send += sent.steps
        if self.stretch_norm is None:
            self.stretch_norm = _l2(
                old_base[n].float() - t for n, t in sorted(sent.sent_params.items())
            )

    @torch.no_grad()
    def rebase(
        self,
        new_base: Mapping[str, torch.Tensor],
        old_base: Mapping[str, torch.Tensor],
        sent: Outgoing | None,
    ) -> None:
        """Move onto a newly certified version (see the module docstring)."""
        params = self.params()
        for n, moved in rebased(params, new_base, old_base, sent):
            p = params[n]
            p.copy_(moved.to(p.device, p.dtype))


def rebase_anchor(
    old_base: Mapping[str, torch.Tensor], sent: Outgoing | None
) -> Mapping[str, torch.Tensor]:
    """What a rebase measures local progress from: θ_sent for the tensors of the delta in
    flight (none: nothing), the old base for every other tensor."""
    if sent is None:
        return old_base
    return {**old_base, **sent.sent_params}


def rebased(
    local: Mapping[str, torch.Tensor],
    new_base: Mapping[str, torch.Tensor],
    old_base: Mapping[str, torch.Tensor],
    sent: Outgoing | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The rebase, tensor by tensor: θ_new + (θ_local − anchor) for each tensor of ``local``,
    float32 on the CPU, anchored as :func:`rebase_anchor` says. One tensor at a time, so a
    caller that copies each back into its model holds one tensor more, not a second model.
    The one place the rebase is computed (``Learner.rebase``, ``IslandLearner.rebase``)."""
    anchor = rebase_anchor(old_base, sent)
    for n, t in local.items():
        yield n, new_base[n].float() + (t.detach().float().cpu() - anchor[n].float())


def _l2(tensors: Iterable[torch.Tensor]) -> float:
    """L2 norm over several tensors, summed in float64 (one tensor in memory at a time)."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))
