"""``join``'s island flags: which island forms, what is refused, and whether the model fits."""

from __future__ import annotations

import pytest

from p2pdiloco.errors import ConfigError
from p2pdiloco.island.spec import IslandSpec, check_island_fits, island_spec
from p2pdiloco.train.island_plan import plan_island
from p2pdiloco.train.memory import ModelTooLarge

GiB = 2**30


def test_several_gpus_form_an_nccl_island_one_rank_per_gpu() -> None:
    spec = island_spec("cuda:0", (0, 2), None, threads=2)
    assert spec == IslandSpec(("cuda:0", "cuda:2"), backend="nccl", threads=2)
    assert island_spec("auto", (1, 3), 2) is not None


def test_cpu_ranks_form_a_gloo_island_and_one_process_is_no_island() -> None:
    assert island_spec("cpu", (), 3) == IslandSpec(("cpu",) * 3, backend="gloo")
    assert island_spec("auto", (), 2) == IslandSpec(("cpu", "cpu"))
    assert island_spec("cpu", (), None) is None
    assert island_spec("cuda:0", (0,), 1) is None


@pytest.mark.parametrize(
    ("device", "gpus", "ranks", "said"),
    [
        ("cpu", (), 0, "at least 1"),
        ("cuda:0", (0, 1), 3, "one rank per GPU"),
        ("cuda:0", (), 2, "takes --gpus"),
        ("cuda:0", (0,), 2, "takes --gpus"),
        ("mps", (), 2, "not mps"),
    ],
)
def test_impossible_islands_are_refused_in_one_line(
    device: str, gpus: tuple[int, ...], ranks: int, said: str
) -> None:
    with pytest.raises(ConfigError, match=said):
        island_spec(device, gpus, ranks)


def test_the_plan_says_how_the_model_trains_or_how_many_devices_it_lacks() -> None:
    line, checkpointing = check_island_fits("gemma-tiny", IslandSpec(("cpu", "cpu")), 4 * GiB)
    assert line.startswith("2 ranks; gemma-tiny needs an island of 1 such devices")
    assert not checkpointing
    line, checkpointing = check_island_fits(
        "gemma-12b", IslandSpec(("cuda:0",) * 9, "nccl"), 80 * GiB
    )
    assert checkpointing and "activation checkpointing" in line
    with pytest.raises(ModelTooLarge, match=r"gemma-12b needs an island of 9 devices of 80.0 GiB"):
        check_island_fits("gemma-12b", IslandSpec(("cuda:0", "cuda:1"), "nccl"), 80 * GiB)


def test_rank_0s_host_must_hold_the_diloco_state() -> None:
    """48 B per parameter on rank 0's host (train.island_plan): 526 GiB for gemma-12b."""
    nine = IslandSpec(("cuda:0",) * 9, "nccl")
    with pytest.raises(ModelTooLarge, match=r"about 526 GiB of host memory on rank 0"):
        check_island_fits("gemma-12b", nine, 80 * GiB, host_bytes=512 * GiB)
    check_island_fits("gemma-12b", nine, 80 * GiB, host_bytes=527 * GiB)
    # On CPU the ranks share the host with that state (12 GiB for gemma-270m): 2 ranks of
    # 22 GiB would each hold gemma-270m alone, but not beside 6 GiB of it each.
    assert plan_island("gemma-270m", "fp32", 22 * GiB) is not None
    cpu = IslandSpec(("cpu", "cpu"))
    with pytest.raises(ModelTooLarge, match="gemma-270m needs an island of 5 devices"):
        check_island_fits("gemma-270m", cpu, 24 * GiB)
    assert check_island_fits("gemma-270m", cpu, 26 * GiB)[0].startswith("2 ranks; gemma-270m")


def test_offload_is_for_cuda_islands_only() -> None:
    assert island_spec("cuda:0", (0, 1), None, offload=True) == IslandSpec(
        ("cuda:0", "cuda:1"), backend="nccl", offload=True
    )
    for device, gpus, ranks in (("cpu", (), 2), ("cpu", (), None), ("cuda:0", (0,), None)):
        with pytest.raises(ConfigError, match="--offload .* needs --gpus"):
            island_spec(device, gpus, ranks, offload=True)


def test_several_visible_gpus_are_one_island_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from p2pdiloco.island.spec import default_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert default_gpus() == (0, 1, 2, 3)
    assert island_spec("auto", default_gpus(), None) == IslandSpec(
        ("cuda:0", "cuda:1", "cuda:2", "cuda:3"), backend="nccl"
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert default_gpus() == ()  # one GPU: one process, as before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_gpus() == ()
