"""Island planning (issue 13 item 3): the fewest devices of one kind that train a model with
FSDP2, each device's share within its memory."""

from __future__ import annotations

import pytest

from p2pdiloco.train.island_plan import _plan, plan_island
from p2pdiloco.train.memory import estimate_memory

GiB = 2**30


@pytest.mark.parametrize(
    "model,precision,gib",
    [("gemma-12b", "bf16-mixed", 24), ("gemma-12b", "bf16-mixed", 80), ("gemma-4b", "bf16", 16)],
)
def test_the_plan_fits_each_device_and_one_device_fewer_would_not(
    model: str, precision: str, gib: int
) -> None:
    plan = plan_island(model, precision, gib * GiB)
    assert plan is not None and plan.devices > 1
    assert plan.per_device <= gib * GiB
    fewer = [
        p
        for b in range(1, plan.micro_batch + 1)
        for ckpt in (False, True)
        if (p := _plan(model, precision, gib * GiB, b, None, ckpt)) is not None
    ]
    assert min(p.devices for p in fewer) == plan.devices  # nothing tried needs fewer
    state = estimate_memory(model, precision, micro_batch=plan.micro_batch)
    sharded = state.weights + state.gradients + state.optimizer + state.diloco_state
    assert plan.shard == sharded // plan.devices


def test_a_model_that_fits_one_device_is_an_island_of_one() -> None:
    plan = plan_island("gemma-tiny", "fp32", 8 * GiB)
    assert plan is not None and (plan.devices, plan.micro_batch) == (1, 8)
    assert not plan.checkpointing


def test_checkpointing_is_planned_only_where_it_saves_devices() -> None:
    big = plan_island("gemma-12b", "bf16-mixed", 80 * GiB)
    assert big is not None and big.checkpointing  # 46 GiB of activations at 1×4096 without
    small = plan_island("gemma-270m", "bf16-mixed", 80 * GiB)
    assert small is not None and small.devices == 1 and not small.checkpointing


def test_a_device_too_small_for_one_micro_batch_has_no_plan() -> None:
    assert plan_island("gemma-12b", "bf16-mixed", 2 * GiB) is None
