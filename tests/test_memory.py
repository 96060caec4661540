"""The one-device memory estimate (``train.memory``) against what one GPU measured, and its
terms shared with the island plan (``train.step_memory``, ADR 0049)."""

from __future__ import annotations

import pytest
import torch

from p2pdiloco.train.island_plan import peak_terms
from p2pdiloco.train.memory import OVERHEAD, GiB, ModelTooLarge, check_fits, estimate_memory
from p2pdiloco.train.model_specs import get_spec, parameter_count
from p2pdiloco.train.step_memory import RESIDENT, step_peak

# Measured on one NVIDIA H200 (torch 2.11.0+cu130, transformers 5.17.0), copied from
# docs/data/gpu_island_h200.json (bench/gpu_island.sh; docs/benchmarks.md, "GPU: island MFU and
# the 12B per-layer memory plan"): every ``plain`` row, the model on one GPU as ``Learner``
# holds it, bf16 autocast, no DiLoCo state on the device (the learner keeps it in host memory).
# (cell, model, micro-batch, sequence, peak GiB, reserved GiB, rest GiB)
MEASURED_PLAIN = [
    ("g1b_plain", "gemma-1b", 4, 2048, 65.57983112335205, 66.583984375, 11.278114318847656),
    ("g4b_plain", "gemma-4b", 2, 2048, 107.53467988967896, 111.615234375, 43.42782258987427),
    ("g1b_prof", "gemma-1b", 4, 2048, 65.57983112335205, 66.583984375, 11.278114318847656),
    ("g4b_prof", "gemma-4b", 2, 2048, 107.5330319404602, 111.615234375, 43.42782258987427),
]
# ``rest_gib`` (between steps) less 12 B per parameter of weights and AdamW moments, every row of
# that file and docs/data/gpu_island_plan_h200.json, FSDP2's too: 0.06 to 0.13 GiB.
MOST_RESIDENT_MEASURED = 0.1338


@pytest.mark.parametrize("row", MEASURED_PLAIN, ids=lambda r: r[0])
def test_the_estimate_is_above_every_measured_one_gpu_peak_and_reserve(row: tuple) -> None:
    _, model, b, seq, peak, reserved, _ = row
    est = estimate_memory(model, "bf16-mixed", b, seq, state_on_device=False)
    assert (est.total - est.overhead) / GiB >= peak  # the count itself, before the allowance
    assert est.total / GiB >= reserved  # and with it, what the allocator took
    assert est.overhead == int((est.total - est.overhead) * OVERHEAD)
    # Within a few percent: an estimate far above the measurement refuses what fits.
    assert (est.total - est.overhead) / GiB <= peak * 1.01


@pytest.mark.parametrize("row", MEASURED_PLAIN, ids=lambda r: r[0])
def test_the_resident_term_covers_what_the_device_held_at_rest(row: tuple) -> None:
    _, model, *_, rest = row
    held = rest - 12 * parameter_count(model) / GiB
    assert 0 < held <= MOST_RESIDENT_MEASURED <= RESIDENT / GiB


def test_one_device_counts_the_island_plans_terms_without_fsdp() -> None:
    """The same casts, activations and logits as one rank of an island at the same shape; what
    differs is only FSDP2's gathered units, which one device does not have."""
    for _, model, b, seq, *_ in MEASURED_PLAIN:
        est = estimate_memory(model, "bf16-mixed", b, seq, state_on_device=False)
        casts, gathered, acts = peak_terms(model, "bf16-mixed", b, seq, False)
        assert est.phase == step_peak(model, "bf16-mixed", b, seq, fsdp=True).phase
        assert (est.casts, est.activations + est.logits) == (casts, acts)
        assert est.in_flight == 0 < gathered  # the loss's backward: no gradient yet in flight
        # a bf16 copy of every parameter but the final norm's (the layers' norms counted too, kB)
        assert est.casts == 2 * (parameter_count(model) - get_spec(model).hidden_size)


def test_the_diloco_state_counts_only_where_the_device_is_host_memory() -> None:
    p = parameter_count("gemma-1b")
    host = estimate_memory("gemma-1b", "bf16-mixed")
    gpu = estimate_memory("gemma-1b", "bf16-mixed", state_on_device=False)
    assert host.diloco_state == 8 * p and gpu.diloco_state == 0
    assert host.total - host.overhead - (gpu.total - gpu.overhead) == 8 * p
    # check_fits decides by the device: a GPU learner keeps its DiLoCo state in host memory
    need = gpu.total
    assert check_fits("gemma-1b", torch.device("cuda"), "bf16-mixed", available=need) == gpu
    with pytest.raises(ModelTooLarge, match="gemma-1b needs about"):
        check_fits("gemma-1b", torch.device("cpu"), "bf16-mixed", available=need)


def test_the_simulator_counts_every_replicas_state_on_the_device() -> None:
    one = estimate_memory("gemma-1b", "bf16-mixed", state_on_device=True)
    per_replica = one.weights + one.gradients + one.optimizer + one.diloco_state
    need = one.total + int(2 * per_replica * (1 + OVERHEAD))
    assert check_fits("gemma-1b", torch.device("cuda"), "bf16-mixed", available=need, replicas=3)
    with pytest.raises(ModelTooLarge, match="3 replicas"):
        check_fits("gemma-1b", torch.device("cuda"), "bf16-mixed", available=need - 1, replicas=3)
