"""``p2pdiloco simulate``: M DiLoCo learners and the outer step in one process, no network.

Beside it, a data-parallel baseline trains one model on exactly the same tokens (step t of the
baseline sees step t of every learner), so the two eval losses compare at equal tokens.

Wire bytes use parameter-server accounting for both methods: at each sync a learner uploads its
fp32 update (a gradient for data-parallel, a pseudo-gradient for DiLoCo) and downloads the new
fp32 values. Data-parallel syncs every inner step; DiLoCo syncs each fragment once per H steps,
so before compression DiLoCo sends H times fewer bytes. With a codec (``compression``), each
learner's delta goes through its own error feedback and the codec, as ``join`` sends it; its
upload then counts the encoded payload bytes.

The outer sync is the network's: attackers transform their own delta (``train.attacks.Attacker``,
omniscient here: they see the honest deltas of the round), then ``sync.aggregator.merge_round``
screens, merges with token weights (``core.weights.merge_weights``, lag 0) and applies the outer
Nesterov step, one fragment at a time. The attackers also see one another's own deltas (the
``collude`` coalition uses them).
"""

from __future__ import annotations

import copy
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from p2pdiloco.aggregate import get_rule
from p2pdiloco.compress import ErrorFeedback, get_codec
from p2pdiloco.core.weights import merge_weights
from p2pdiloco.errors import ConfigError
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.sync.aggregator import MergeError, MergeInput, MergeResult, merge_round
from p2pdiloco.sync.scoring import WorkCheck, WorkScorer
from p2pdiloco.sync.update import rules_codec
from p2pdiloco.train.attacks import AttackConfig, Attacker
from p2pdiloco.train.configs import InnerConfig, OuterConfig, SimulateConfig
from p2pdiloco.train.data import (
    PackedCorpus,
    build_corpus,
    data_parallel_batches,
    eval_batches,
    learner_batches,
    learner_row_indices,
)
from p2pdiloco.train.device import resolve_device
from p2pdiloco.train.inner import evaluate, make_inner_optimizer, train_steps
from p2pdiloco.train.memory import check_fits
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.outer import partition_fragments, pseudo_gradient
from p2pdiloco.train.tokenizer import load_tokenizer

# (description, completed work units, total work units); one unit = one learner inner step.
ProgressFn = Callable[[str, int, int], None]


@dataclass
class MethodResult:
    """Outcome of one method (DiLoCo or data-parallel) at equal tokens."""

    method: str
    eval_loss_initial: float
    eval_loss_final: float
    eval_losses: list[float]  # after every ``eval_every``-th round and the last
    train_loss_last: float
    tokens: int
    wire_bytes: int  # all learners together, uncompressed fp32
    syncs: int  # synchronisation events per learner
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SimulationResult:
    model: str
    parameters: int
    device: str
    learners: int
    inner_steps: int
    rounds: int
    fragments: int
    corpus: dict[str, Any]
    diloco: MethodResult
    baseline: MethodResult | None
    peak_memory_bytes: int
    aggregation: str = "mean"
    compression: str = "none"
    update_codec: str = "none"  # codec of the merged update the outer step applied (ADR 0029)
    update_form: str = "gradient"  # "params": the parameters' change, fed back (ADR 0064)
    update_k: int | None = None  # entries kept per 4096 by a topk2 update codec
    adversaries: list[int] = field(default_factory=list)  # learner indices that attacked
    attack: str | None = None
    accepted_deltas: list[int] = field(default_factory=list)  # per learner, over the run
    rejected_deltas: list[int] = field(default_factory=list)  # per learner (screening)
    # per learner: accepted deltas merged as another's copy (clone folding, ADR 0036)
    folded_deltas: list[int] = field(default_factory=list)
    # per learner: accepted deltas merged without credit, no work shown (ADR 0065)
    uncredited_deltas: list[int] = field(default_factory=list)

    @property
    def loss_ratio(self) -> float | None:
        """DiLoCo / data-parallel final eval loss (target ≤ 1.02)."""
        return (
            self.diloco.eval_loss_final / self.baseline.eval_loss_final if self.baseline else None
        )

    @property
    def bytes_ratio(self) -> float | None:
        """Data-parallel / DiLoCo bytes on the wire (≥ H before compression)."""
        return self.baseline.wire_bytes / self.diloco.wire_bytes if self.baseline else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("diloco", "baseline"):
            method: MethodResult | None = getattr(self, key)
            if method is not None:
                d[key]["tokens_per_second"] = method.tokens_per_second
        d["loss_ratio"] = self.loss_ratio
        d["bytes_ratio"] = self.bytes_ratio
        return d


def prepare(cfg: SimulateConfig) -> tuple[torch.device, PackedCorpus]:
    """Validate the config, check memory before any allocation, and build the corpus.

    Raises ConfigError for inconsistent sizes, ModelError/ModelTooLarge/DeviceError/DataError/
    TokenizerUnavailable with one-line messages otherwise.
    """
    spec = get_spec(cfg.model)
    if cfg.learners < 1 or cfg.inner_steps < 1 or cfg.rounds < 1 or cfg.eval_every < 1:
        raise ConfigError("--learners, --inner-steps, --rounds and eval_every must be at least 1")
    if cfg.inner_steps % cfg.outer.fragments:
        raise ConfigError(
            f"--inner-steps {cfg.inner_steps} must be a multiple of --fragments "
            f"{cfg.outer.fragments} (fragments sync at staggered points H/F steps apart)"
        )
    device = resolve_device(cfg.device)
    replicas = cfg.learners + 1 + (1 if cfg.baseline else 0)
    check_fits(
        cfg.model,
        device,
        "bf16-mixed" if device.type in ("cuda", "xla") else "fp32",
        micro_batch=cfg.inner.batch_size // cfg.inner.grad_accum,
        seq_len=cfg.inner.seq_len,
        replicas=replicas,
    )
    tokenizer = load_tokenizer(cfg.tokenizer or spec.tokenizer)
    if tokenizer.vocab_size > spec.vocab_size:
        raise ConfigError(
            f"tokenizer '{tokenizer.name}' has {tokenizer.vocab_size} ids but {cfg.model} "
            f"embeds only {spec.vocab_size}"
        )
    corpus = build_corpus(
        cfg.data, tokenizer, seq_len=cfg.inner.seq_len, max_bytes=cfg.max_data_bytes
    )
    return device, corpus


def run_simulation(cfg: SimulateConfig, progress: ProgressFn | None = None) -> SimulationResult:
    """Train DiLoCo (and the data-parallel baseline) on the same tokens; return both losses.
    ConfigError (before any work) for a codec this build lacks."""
    get_codec(cfg.compression)
    get_codec(cfg.compression_first)
    try:
        rules_codec(cfg.rules)
    except ValueError as e:  # a sparse gradient update: certify the parameters' change
        raise ConfigError(f"{e}; a sparse update needs --update-form params") from None
    device, corpus = prepare(cfg)
    total_units = cfg.rounds * cfg.inner_steps * cfg.learners * (2 if cfg.baseline else 1)
    done = 0

    def tick(desc: str, units: int) -> None:
        nonlocal done
        done += units
        if progress:
            progress(desc, done, total_units)

    if progress:
        progress("starting", 0, total_units)
    evals = eval_batches(corpus, batch_size=cfg.inner.batch_size, max_batches=cfg.eval_batches)
    inner = replace(cfg.inner, total_steps=cfg.rounds * cfg.inner_steps)
    initial = build_model(cfg.model, seed=cfg.seed, init_from=cfg.init_from, device=device)
    n_params = sum(p.numel() for p in param_state(initial).values())

    attackers = build_attackers(cfg)  # before any training: a bad rule or attack fails fast
    counts = _Verdicts(*([0] * cfg.learners for _ in range(4)))
    diloco = _run_diloco(cfg, inner, corpus, evals, copy.deepcopy(initial), tick, attackers, counts)
    baseline = (
        _run_data_parallel(cfg, inner, corpus, evals, initial, tick) if cfg.baseline else None
    )

    return SimulationResult(
        model=cfg.model,
        parameters=n_params,
        device=str(device),
        learners=cfg.learners,
        inner_steps=cfg.inner_steps,
        rounds=cfg.rounds,
        fragments=cfg.outer.fragments,
        corpus={
            "source": corpus.source,
            "fingerprint": corpus.fingerprint,
            "documents": corpus.num_documents,
            "train_sequences": int(corpus.train_NS.shape[0]),
            "eval_sequences": int(corpus.eval_NS.shape[0]),
            "tokenizer": corpus.tokenizer_name,
        },
        diloco=diloco,
        baseline=baseline,
        peak_memory_bytes=_peak_memory(device),
        aggregation=cfg.rules.aggregation,
        compression=cfg.compression,
        update_codec=cfg.rules.update_codec,
        update_form=cfg.rules.update_form,
        update_k=cfg.rules.update_k,
        adversaries=sorted(attackers),
        attack=cfg.attack if cfg.adversaries else None,
        accepted_deltas=counts.accepted,
        rejected_deltas=counts.rejected,
        folded_deltas=counts.folded,
        uncredited_deltas=counts.uncredited,
    )


def train_method(
    cfg: SimulateConfig,
    method: str,
    corpus: PackedCorpus,
    evals: list[torch.Tensor],
    model: torch.nn.Module,
) -> MethodResult:
    """One method of ``run_simulation`` alone, ``"diloco"`` or ``"data-parallel"``: trains
    ``model`` in place (DiLoCo: the global model) on the rows ``run_simulation`` would give it,
    so two calls at different settings compare at equal tokens (``bench/parity.py`` tunes each
    method on its own grid this way). ``corpus`` comes from ``prepare(cfg)``.

    Raises ConfigError as ``run_simulation`` does, ValueError for another method name.
    """
    if method not in ("diloco", "data-parallel"):
        raise ValueError(f"method is 'diloco' or 'data-parallel', not {method!r}")
    get_codec(cfg.compression)
    get_codec(cfg.compression_first)
    inner = replace(cfg.inner, total_steps=cfg.rounds * cfg.inner_steps)
    if method == "data-parallel":
        return _run_data_parallel(cfg, inner, corpus, evals, model, lambda _d, _u: None)
    counts = _Verdicts(*([0] * cfg.learners for _ in range(4)))
    return _run_diloco(
        cfg, inner, corpus, evals, model, lambda _d, _u: None, build_attackers(cfg), counts
    )


@dataclass
class _Verdicts:
    accepted: list[int]  # per learner: deltas merged
    rejected: list[int]  # per learner: deltas screened out
    folded: list[int]  # per learner: accepted deltas merged as another's copy
    uncredited: list[int]  # per learner: accepted deltas merged without credit (ADR 0065)


def build_attackers(cfg: SimulateConfig) -> dict[int, Attacker]:
    """The last ``cfg.adversaries`` learners' attackers, by learner index; checks the rule too.

    Raises ConfigError for an unknown rule or attack, bad rule parameters, or too many attackers.
    """
    if not 0 <= cfg.adversaries < cfg.learners:
        raise ConfigError("--adversaries must be at least 0 and fewer than --learners")
    try:
        get_rule(cfg.rules.aggregation, **cfg.rules.aggregation_params)
        if not cfg.adversaries:
            return {}
        attack = AttackConfig(cfg.attack, seed=cfg.seed, jitter=cfg.attack_jitter)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    first = cfg.learners - cfg.adversaries
    return {
        i: Attacker(attack, num_learners=cfg.learners, num_attackers=cfg.adversaries, member=i)
        for i in range(first, cfg.learners)
    }


def learner_id(i: int) -> str:
    """The merge-input id of simulated learner ``i`` (sorts in learner order)."""
    return f"learner-{i:06d}"


def merge_fragment(
    theta: Mapping[str, torch.Tensor],
    momentum: dict[str, torch.Tensor],
    deltas: Sequence[Mapping[str, torch.Tensor]],
    tokens: Sequence[int],
    names: Sequence[str],
    *,
    rules: SyncRules,
    outer: OuterConfig,
    residual: dict[str, torch.Tensor] | None = None,
    work: WorkCheck | None = None,
    last_update: dict[str, torch.Tensor] | None = None,
) -> MergeResult:
    """The outer step of fragment ``names``, as a syncer makes it, applied to the live model.

    ``deltas`` and ``tokens`` are per learner (in learner order), as sent. Learner i's input is
    ``learner_id(i)`` with weight ``merge_weights`` of its tokens at lag 0. Copies the merged
    values into ``theta`` (in place, the global model) and the buffers into ``momentum``, and
    with "params" updates (``rules.update_form``, ADR 0064) the committee's error-feedback
    residuals into ``residual`` (required then); with ``last_update``, the decoded merged update of these names goes there (what the next
    ``work`` check compares deltas with). Raises MergeError (nothing changed) when screening
    rejects every delta.
    """
    feedback = rules.update_form == "params"
    if feedback and residual is None:
        raise ValueError("a run of params updates merges with the committee's residual")
    ids = [learner_id(i) for i in range(len(deltas))]
    weights = merge_weights(
        {k: (t, 0) for k, t in zip(ids, tokens, strict=True)}, cap_fraction=rules.weight_cap
    )
    inputs = [
        MergeInput(digest=k, peer_id=k, delta=d, weight=weights[k])
        for k, d in zip(ids, deltas, strict=True)
    ]
    result = merge_round(
        {n: theta[n] for n in names},
        {n: momentum[n] for n in names if n in momentum},
        inputs,
        rules=rules,
        outer=outer,
        update_codec=rules_codec(rules),  # as sync.certified.next_state does
        residual={n: residual[n] for n in names if n in residual}
        if feedback and residual is not None
        else None,
        work=work,
    )
    if last_update is not None:
        codec = rules_codec(rules)
        last_update.update({n: codec.decode(e) for n, e in result.update.items()})
    result.update = {}
    with torch.no_grad():
        for n in names:
            theta[n].copy_(result.params[n])
    momentum.update(result.momentum)
    if residual is not None:
        residual.update(result.residual)
    return result


def shard_rows(
    num_rows: int, cfg: SimulateConfig, steps: int
) -> Callable[[str, int], tuple[torch.Tensor, torch.Tensor]]:
    """The rows ``learner_id(i)`` trains on in sub-round v (``learner_batches``) and every
    other row: what work scoring measures a simulated learner's advantage on."""
    ids = {learner_id(i): i for i in range(cfg.learners)}

    def rows_of(peer: str, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        own = learner_row_indices(
            num_rows,
            seed=cfg.seed,
            learner=ids[peer],
            num_learners=cfg.learners,
            round=version,
            steps=steps,
            batch_size=cfg.inner.batch_size,
        ).reshape(-1)
        mask = torch.ones(num_rows, dtype=torch.bool)
        mask[own] = False
        return own, torch.nonzero(mask).squeeze(1)

    return rows_of


def _run_diloco(
    cfg: SimulateConfig,
    inner: InnerConfig,
    corpus: PackedCorpus,
    evals: list[torch.Tensor],
    global_model: torch.nn.Module,
    tick: Callable[[str, int], None],
    attackers: Mapping[int, Attacker],
    counts: _Verdicts,
) -> MethodResult:
    t0 = time.perf_counter()
    theta = param_state(global_model)  # the global parameters, updated in place
    fragments = partition_fragments({n: t.numel() for n, t in theta.items()}, cfg.outer.fragments)
    momentum: dict[str, torch.Tensor] = {}  # outer Nesterov buffers, as certified state holds
    residual: dict[str, torch.Tensor] = {}  # the committee's update residual (ADR 0064)
    learners = []
    for _ in range(cfg.learners):
        model = copy.deepcopy(global_model)
        learners.append((model, *make_inner_optimizer(model, inner)))
    steps_per_sync = cfg.inner_steps // len(fragments)
    later = get_codec(cfg.compression)
    first = get_codec(cfg.compression_first) if cfg.compression_first_rounds else later
    feedback = (
        [ErrorFeedback(first) for _ in range(cfg.learners)]
        if {first.name, later.name} != {"none"}
        else []
    )
    uploaded = 0  # encoded payload bytes, all learners (with a codec)
    scorer = (
        WorkScorer(
            copy.deepcopy(global_model),
            corpus.train_NS,
            cfg.rules.work,
            cfg.seed,
            rows_of=shard_rows(corpus.num_train_rows, cfg, cfg.inner_steps // len(fragments)),
        )
        if cfg.rules.work is not None
        else None
    )
    last_update: dict[str, torch.Tensor] = {}  # the merged update, as the committee certified it

    loss0 = evaluate(global_model, evals)
    losses, last_train, tokens, syncs = [], 0.0, 0, 0
    for rnd in range(cfg.rounds):
        for ef in feedback:  # the residual carries over when the schedule changes codec
            ef.codec = first if rnd < cfg.compression_first_rounds else later
        for f, names in enumerate(fragments):
            sub_round = rnd * len(fragments) + f
            sent_tokens = []
            for i, (model, opt, sched) in enumerate(learners):
                batches = learner_batches(
                    corpus,
                    seed=cfg.seed,
                    learner=i,
                    num_learners=cfg.learners,
                    round=sub_round,
                    steps=steps_per_sync,
                    batch_size=inner.batch_size,
                )
                stats = train_steps(
                    model,
                    opt,
                    sched,
                    batches,
                    grad_accum=inner.grad_accum,
                    grad_clip=inner.grad_clip,
                )
                tokens += stats.tokens
                sent_tokens.append(stats.tokens)
                last_train = stats.loss_last
                tick(
                    f"DiLoCo round {rnd + 1}/{cfg.rounds} learner {i + 1}: "
                    f"train loss {stats.loss_last:.3f}",
                    stats.steps,
                )

            # Outer step on fragment f: attackers transform their own delta, the syncer's merge
            # screens, merges and applies Nesterov, then every learner continues from the new
            # global values of that fragment (or the old ones, if nothing could be merged).
            deltas = [pseudo_gradient(theta, param_state(m), names) for m, _, _ in learners]
            if feedback:  # what each learner sends: its delta plus residual, through the codec
                sent = [_sent(feedback[i], d) for i, d in enumerate(deltas)]
                deltas = [d for d, _ in sent]
                uploaded += sum(nbytes for _, nbytes in sent)
            honest = [d for i, d in enumerate(deltas) if i not in attackers]
            coalition = [deltas[i] for i in sorted(attackers)]  # their own, before poisoning
            for i, attacker in attackers.items():
                deltas[i] = attacker.transform(deltas[i], honest, sub_round, coalition)
            work = (
                WorkCheck(
                    cfg.rules.work,
                    scorer.bind(theta, sub_round),
                    last_update if all(n in last_update for n in names) else None,
                    seed=sub_round,
                    # The learners are a run's established members, all trusted: a delta that
                    # shows no work is merged uncredited, as once trust is earned (ADR 0066)
                    trust_earned=True,
                )
                if scorer is not None and cfg.rules.work is not None
                else None
            )
            try:
                result = merge_fragment(
                    theta,
                    momentum,
                    deltas,
                    sent_tokens,
                    names,
                    rules=cfg.rules,
                    outer=cfg.outer,
                    residual=residual,
                    work=work,
                    last_update=last_update if work is not None else None,
                )
                verdict_accepted, verdict_rejected = result.accepted, result.rejected
                folded, uncredited = result.folded, result.uncredited
            except MergeError as e:
                verdict_accepted, verdict_rejected, folded, uncredited = [], e.rejected, {}, []
            for i in range(cfg.learners):
                counts.accepted[i] += learner_id(i) in verdict_accepted
                counts.rejected[i] += learner_id(i) in verdict_rejected
                counts.folded[i] += learner_id(i) in folded
                counts.uncredited[i] += learner_id(i) in uncredited
            for model, _, _ in learners:
                local = param_state(model)
                with torch.no_grad():
                    for n in names:
                        local[n].copy_(theta[n])
            syncs += 1
        if _evaluates(cfg, rnd):
            losses.append(evaluate(global_model, evals))
            tick(f"DiLoCo round {rnd + 1}/{cfg.rounds}: eval loss {losses[-1]:.4f}", 0)

    n_params = sum(t.numel() for t in theta.values())
    # Each round every learner sends its Δ for all fragments (fp32, or as encoded) and gets the
    # new fp32 values back.
    down = cfg.rounds * cfg.learners * n_params * 4
    wire = down + (uploaded if feedback else down)
    return MethodResult(
        method="diloco",
        eval_loss_initial=loss0,
        eval_loss_final=losses[-1],
        eval_losses=losses,
        train_loss_last=last_train,
        tokens=tokens,
        wire_bytes=wire,
        syncs=syncs,
        seconds=time.perf_counter() - t0,
    )


def _run_data_parallel(
    cfg: SimulateConfig,
    inner: InnerConfig,
    corpus: PackedCorpus,
    evals: list[torch.Tensor],
    model: torch.nn.Module,
    tick: Callable[[str, int], None],
) -> MethodResult:
    t0 = time.perf_counter()
    opt, sched = make_inner_optimizer(model, inner)
    steps_per_chunk = cfg.inner_steps // cfg.outer.fragments
    loss0 = evaluate(model, evals)
    losses, last_train, tokens, steps = [], 0.0, 0, 0
    for rnd in range(cfg.rounds):
        for f in range(cfg.outer.fragments):
            batches = data_parallel_batches(
                corpus,
                seed=cfg.seed,
                num_learners=cfg.learners,
                round=rnd * cfg.outer.fragments + f,
                steps=steps_per_chunk,
                batch_size=inner.batch_size,
            )
            stats = train_steps(
                model,
                opt,
                sched,
                batches,
                grad_accum=inner.grad_accum * cfg.learners,
                grad_clip=inner.grad_clip,
            )
            tokens += stats.tokens
            steps += stats.steps
            last_train = stats.loss_last
            tick(
                f"data-parallel round {rnd + 1}/{cfg.rounds}: train loss {stats.loss_last:.3f}",
                stats.steps * cfg.learners,
            )
        if _evaluates(cfg, rnd):
            losses.append(evaluate(model, evals))
            tick(f"data-parallel round {rnd + 1}/{cfg.rounds}: eval loss {losses[-1]:.4f}", 0)
    n_params = sum(p.numel() for p in param_state(model).values())
    wire = steps * cfg.learners * 2 * n_params * 4
    return MethodResult(
        method="data-parallel",
        eval_loss_initial=loss0,
        eval_loss_final=losses[-1],
        eval_losses=losses,
        train_loss_last=last_train,
        tokens=tokens,
        wire_bytes=wire,
        syncs=steps,
        seconds=time.perf_counter() - t0,
    )


def _evaluates(cfg: SimulateConfig, rnd: int) -> bool:
    """Whether round ``rnd`` (from 0) ends with an eval: every ``eval_every``-th and the last."""
    return (rnd + 1) % cfg.eval_every == 0 or rnd + 1 == cfg.rounds


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sent(
    ef: ErrorFeedback, delta: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], int]:
    """``delta`` as the syncer decodes it after ``ef`` compressed it (residual kept in ``ef``),
    and the encoded payload bytes."""
    out, nbytes = {}, 0
    for n, t in delta.items():
        enc = ef.compress(n, t)
        out[n], nbytes = ef.codec.decode(enc).to(t.device), nbytes + enc.nbytes()
    return out, nbytes
