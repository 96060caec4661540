"""Shared fixtures: offline hub, and no child process outlives its test."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import psutil
import pytest

# Tests never touch the network: the hub is off for transformers/huggingface_hub/datasets.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _is_infrastructure(proc: psutil.Process) -> bool:
    """Process-wide helpers that outlive tests by design: killing them breaks later tests
    (torch aborts on its next shared-memory allocation once its manager is gone)."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "torch_shm_manager" in cmd or "resource_tracker" in cmd


@pytest.fixture(autouse=True)
def _kill_leftover_children() -> Iterator[None]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leftovers = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and not _is_infrastructure(p)
    ]
    for child in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(leftovers, timeout=10)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Torch on one intra-op thread for the test: whole nodes in one process each train on
    their own thread, and oversubscribing 2 cores makes every round slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
