"""Island planning (issue 13 item 3): the fewest devices of one kind that train a model with
FSDP2, each device's share within its memory, and the plan against what a GPU measured."""

from __future__ import annotations

from dataclasses import replace

import pytest

from p2pdiloco.train import model_specs
from p2pdiloco.train.island_plan import (
    ALLOWANCE,
    HOST_BYTES_PER_PARAM,
    _plan,
    peak_terms,
    plan_island,
)
from p2pdiloco.train.memory import estimate_memory
from p2pdiloco.train.model_specs import parameter_count

GiB = 2**30
H200 = int(139.80072021484375 * GiB)  # what torch saw of the measuring H200

# Measured on one NVIDIA H200 (torch 2.11.0+cu130, transformers 5.17.0), copied from
# docs/data/gpu_island_h200.json (bench/gpu_island.sh; docs/benchmarks.md, "GPU: island MFU and
# the 12B per-layer memory plan"): the island's FSDP2 path on one rank, bf16 autocast.
# (model, decoder layers, micro-batch, sequence, checkpointing, peak GiB, reserved GiB)
MEASURED = [
    ("gemma-12b", 2, 1, 4096, True, 39.6765456199646, 49.599609375),
    ("gemma-12b", 6, 1, 4096, True, 53.80372142791748, 65.177734375),
    ("gemma-12b", 10, 1, 4096, True, 69.08763408660889, 81.873046875),
    ("gemma-12b", 2, 2, 2048, False, 43.20440626144409, 51.806640625),
    ("gemma-12b", 6, 2, 2048, False, 63.86819887161255, 72.85546875),
    ("gemma-1b", 26, 4, 2048, False, 66.72180318832397, 72.8125),
    ("gemma-4b", 34, 2, 2048, False, 110.05934762954712, 121.712890625),
    # docs/data/gpu_island_plan_h200.json: measured after the plan was corrected, to check it
    ("gemma-4b", 34, 1, 4096, True, 79.10223484039307, 94.7890625),
]
# The same file's per-layer figures (``per_layer.measured_per_layer_gib``): peak GiB per decoder
# layer of gemma-12b, from the lowest to the highest layer count measured at that shape.
MEASURED_PER_LAYER = {(1, 4096, True): 3.676386058330536, (2, 2048, False): 5.165948152542114}
RESERVE = max(r[6] / r[5] for r in MEASURED)  # the allocator's reserve over the peak: 1.250


def _layered(monkeypatch: pytest.MonkeyPatch, model: str, layers: int) -> str:
    """``model`` at its real width with ``layers`` decoder layers, as bench/gpu_island.py
    names it."""
    spec = model_specs.get_spec(model)
    if layers == spec.num_layers:
        return model
    name = f"{model}@L{layers}"
    monkeypatch.setitem(model_specs.REGISTRY, name, replace(spec, name=name, num_layers=layers))
    return name


def _one_device(name: str, b: int, seq: int, ckpt: bool) -> float:
    plan = _plan(name, "bf16-mixed", 2**60, b, seq, ckpt)
    assert plan is not None and plan.devices == 1
    return plan.per_device / GiB


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: f"{r[0]}@L{r[1]}-{r[2]}x{r[3]}-{r[4]}")
def test_the_plan_is_above_every_measured_peak_and_reserve(
    monkeypatch: pytest.MonkeyPatch, row: tuple
) -> None:
    model, layers, b, seq, ckpt, peak, reserved = row
    plan = _one_device(_layered(monkeypatch, model, layers), b, seq, ckpt)
    assert plan >= reserved  # what the allocator took, the allowance included
    assert plan / (1 + ALLOWANCE) >= peak  # and the model itself, before the allowance


@pytest.mark.parametrize("shape", sorted(MEASURED_PER_LAYER))
def test_the_plan_per_layer_is_at_or_above_the_measured(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int, bool]
) -> None:
    b, seq, ckpt = shape
    rows = [r for r in MEASURED if r[0] == "gemma-12b" and r[2:5] == shape]
    plan = {r[1]: _one_device(_layered(monkeypatch, "gemma-12b", r[1]), b, seq, ckpt) for r in rows}
    for lo, hi in [(rows[0], rows[-1]), *zip(rows, rows[1:], strict=False)]:
        dl = hi[1] - lo[1]
        per_layer = (plan[hi[1]] - plan[lo[1]]) / dl
        assert per_layer >= (hi[6] - lo[6]) / dl  # the reserve per layer
        assert per_layer >= (hi[5] - lo[5]) / dl * RESERVE  # the peak's, with the most reserve
    whole = (plan[rows[-1][1]] - plan[rows[0][1]]) / (rows[-1][1] - rows[0][1])
    assert whole >= MEASURED_PER_LAYER[shape] * RESERVE


@pytest.mark.parametrize(("device", "devices"), [(80 * GiB, 9), (H200, 3)])
def test_the_measured_line_fits_the_planned_12b_island(device: int, devices: int) -> None:
    """The full gemma-12b's rank extrapolated from the checkpointed rows (the steeper segment,
    6 to 10 layers), its 16 B per parameter of weights, gradients and moments split over the
    plan's ranks, with the largest reserve measured: within the plan and within the device."""
    plan = plan_island("gemma-12b", "bf16-mixed", device)
    assert plan is not None and (plan.devices, plan.micro_batch, plan.checkpointing) == (
        devices,
        1,
        True,
    )
    l6, l10 = (r for r in MEASURED if r[0] == "gemma-12b" and r[1] in (6, 10) and r[4])
    one_rank = l10[5] + (48 - 10) * (l10[5] - l6[5]) / 4
    state = 16 * parameter_count("gemma-12b") / GiB
    measured = one_rank - state + state / plan.devices
    assert measured * RESERVE <= plan.per_device / GiB <= device / GiB


@pytest.mark.parametrize(
    "model,precision,gib",
    [("gemma-12b", "bf16-mixed", 80), ("gemma-4b", "bf16-mixed", 48), ("gemma-4b", "bf16", 24)],
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
    sharded = state.weights + state.gradients + state.optimizer
    assert plan.shard == sharded // plan.devices


def test_the_diloco_state_is_on_rank_0s_host_not_on_the_devices() -> None:
    plan = plan_island("gemma-12b", "bf16-mixed", 80 * GiB)
    assert plan is not None
    p = parameter_count("gemma-12b")
    assert plan.host == HOST_BYTES_PER_PARAM * p
    assert plan.shard == 16 * p // plan.devices  # weights, gradients, AdamW: no base, no EF
    assert f"rank 0's host about {plan.host / GiB:.0f} GiB" in plan.describe()


def test_autocast_weight_copies_are_not_sharded() -> None:
    """Every bf16 weight copy is held at the forward's end on every rank: 2 B per parameter
    of the whole model, so no number of 24 GiB devices holds gemma-12b in bf16-mixed."""
    casts, _, _ = peak_terms("gemma-12b", "bf16-mixed", 1, 4096, True)
    assert casts == 2 * (
        parameter_count("gemma-12b") - model_specs.get_spec("gemma-12b").hidden_size
    )
    assert peak_terms("gemma-12b", "fp32", 1, 4096, True)[0] == 0  # no autocast, no copies
    assert plan_island("gemma-12b", "bf16-mixed", 24 * GiB) is None


def test_a_model_that_fits_one_device_is_an_island_of_one() -> None:
    plan = plan_island("gemma-tiny", "fp32", 8 * GiB)
    assert plan is not None and (plan.devices, plan.micro_batch) == (1, 8)
    assert not plan.checkpointing
    for model, ckpt in (("gemma-1b", False), ("gemma-4b", True)):  # one H200 each
        one = plan_island(model, "bf16-mixed", H200)
        assert one is not None and (one.devices, one.checkpointing) == (1, ckpt)


def test_checkpointing_is_planned_only_where_it_saves_devices() -> None:
    big = plan_island("gemma-12b", "bf16-mixed", 80 * GiB)
    assert big is not None and big.checkpointing  # 67 GiB of activations at 1×4096 without
    small = plan_island("gemma-270m", "bf16-mixed", 80 * GiB)
    assert small is not None and small.devices == 1 and not small.checkpointing


def test_a_device_too_small_for_one_micro_batch_has_no_plan() -> None:
    assert plan_island("gemma-12b", "bf16-mixed", 2 * GiB) is None
