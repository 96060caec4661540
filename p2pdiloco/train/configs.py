"""Training configuration records: inner and outer optimizer hyperparameters, one simulated run.

Plain dataclasses without torch, so the command line can show their defaults in ``--help`` and
check a user's values in milliseconds; the code that uses them lives in ``train.inner``,
``train.outer`` and ``harness.simulate`` (which re-export them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pdiloco.protocol.records import SyncRules


@dataclass
class InnerConfig:
    """Inner-optimizer hyperparameters (DiLoCo defaults; each is a run-manifest field)."""

    lr: float = 4e-4  # peak AdamW learning rate
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1  # applied to matrices only, never to norms
    warmup_steps: int = 100  # linear warmup, counted in inner steps of one learner
    total_steps: int = 10_000  # cosine horizon in inner steps; the schedule ends at min_lr
    min_lr_ratio: float = 0.1  # final lr = lr × min_lr_ratio
    grad_clip: float = 1.0  # global-norm clip per step; 0 disables
    grad_accum: int = 1  # micro-batches per step; the step batch is split evenly
    batch_size: int = 8  # sequences per inner step (before accumulation split)
    seq_len: int = 128  # tokens per sequence


@dataclass
class OuterConfig:
    """Outer-optimizer hyperparameters (DiLoCo defaults; each is a run-manifest field)."""

    lr: float = 0.7  # outer learning rate η
    momentum: float = 0.9  # μ
    nesterov: bool = True
    fragments: int = 1  # Streaming DiLoCo fragments; 1 = plain DiLoCo


@dataclass
class SimulateConfig:
    """One simulated run. Inner/outer defaults follow DiLoCo; sizes suit 2 CPU cores."""

    model: str = "gemma-tiny"
    learners: int = 4  # M, DiLoCo replicas
    inner_steps: int = 20  # H, inner steps between two syncs of a fragment
    rounds: int = 5  # outer rounds (each fragment syncs once per round)
    seed: int = 0  # run seed: init, data order, sharding
    data: str = "embedded"  # "embedded", a directory or file, or "hf:NAME[:CONFIG][@SPLIT]"
    tokenizer: str | None = None  # None: the model's default tokenizer
    device: str = "auto"
    eval_batches: int = 8  # eval batches of inner.batch_size rows at each round end
    eval_every: int = 1  # rounds between two evals (the last round is always evaluated)
    max_data_bytes: int = 16 * 2**20  # cap on text read from the source
    init_from: str | None = None  # local Hugging Face checkpoint instead of random init
    baseline: bool = True  # also train the data-parallel baseline
    # The merge rules of a run manifest: rule and its params, screening, weight cap (the
    # round-timing fields do not apply in one process).
    rules: SyncRules = field(default_factory=SyncRules)
    adversaries: int = 0  # the last N learners poison their deltas
    attack: str = "sign-flip"  # p2pdiloco.train.attacks.ATTACKS
    # Each attacker adds its own noise of this × the honest per-coordinate std (AttackConfig
    # .jitter): copies that stay apart from one another, to measure clone folding's limit.
    attack_jitter: float = 0.0
    compression: str = "none"  # delta codec (p2pdiloco.compress.CODECS), with error feedback
    # A codec for the first rounds instead (e.g. int8 before topk2); the residual carries over.
    compression_first: str = "none"
    compression_first_rounds: int = 0  # rounds that use ``compression_first``
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
