"""A run's inner learning-rate schedule from its planned size (ADR 0053).

Pure arithmetic, no torch: ``run create`` checks a plan in milliseconds. Every learner puts
its schedule at global step ``version × steps per delta`` (``core.learner``), so the horizon
is counted in one learner's inner steps, not in the run's steps summed over learners: a run
planned for R rounds of H steps ends its cosine at ``R × H`` whatever the number of learners.
Planned tokens are global (every learner together), so turning them into rounds needs the
number of learners a round is planned to merge.
"""

from __future__ import annotations

import math

from pydantic import ValidationError

from p2pdiloco.errors import ConfigError
from p2pdiloco.protocol.records import RunPlan

# Warm-up is a tenth of the horizon: the rule ``simulate`` trains every measured figure with
# (docs/benchmarks.md), so a network run follows the schedule its benchmarks used.
WARMUP_PARTS = 10
# Learners a round is planned to merge when the creator does not say (the benchmarks' M).
DEFAULT_LEARNERS = 4


def plan_run(
    *,
    inner_steps: int,
    batch_size: int,
    seq_len: int,
    rounds: int | None = None,
    tokens: int | None = None,
    learners: int = DEFAULT_LEARNERS,
) -> RunPlan:
    """The plan of a run of ``rounds`` rounds, or of ``tokens`` tokens over ``learners``
    learners (rounds rounded up). Raises ConfigError unless exactly one size is given and
    every count is positive."""
    if (rounds is None) == (tokens is None):
        raise ConfigError("give the run's planned size as --tokens N or --rounds N, not both")
    if min(inner_steps, batch_size, seq_len, learners) < 1:
        raise ConfigError("inner steps, batch size, sequence length and learners must be ≥ 1")
    per_round = learners * inner_steps * batch_size * seq_len
    if tokens is not None:
        if tokens < 1:
            raise ConfigError(f"--tokens {tokens} must be at least 1")
        rounds = math.ceil(tokens / per_round)
    assert rounds is not None
    if rounds < 1:
        raise ConfigError(f"--rounds {rounds} must be at least 1")
    try:
        return RunPlan(rounds=rounds, tokens=rounds * per_round, learners=learners)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(
            f"invalid run plan {'.'.join(map(str, err['loc']))}: {err['msg']}"
        ) from None


def schedule_of(plan: RunPlan, inner_steps: int) -> tuple[int, int]:
    """``(warmup_steps, total_steps)`` of the inner schedule of ``plan``: the cosine ends after
    the planned rounds, the warm-up takes a ``WARMUP_PARTS``-th of it (at least one step)."""
    total = plan.rounds * inner_steps
    return max(1, total // WARMUP_PARTS), total


def past_horizon(global_step: int, total_steps: int) -> bool:
    """Whether a learner at ``global_step`` has gone past the run's cosine horizon: its lr
    stays at the floor (``min_lr_ratio`` × lr) from there on."""
    return global_step >= total_steps
