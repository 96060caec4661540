"""Shared fixtures: offline hub, and no child process outlives its test."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import p2pdiloco.demo
import tests.zygote as zygote_mod

# Tests never touch the network: the hub is off for transformers/huggingface_hub/datasets.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _is_infrastructure(proc: psutil.Process) -> bool:
    """Process-wide helpers that outlive tests by design: killing them breaks later tests
    (torch aborts on its next shared-memory allocation once its manager is gone), and this
    worker's zygote (tests/zygote.py; the commands it forked are not spared)."""
    if zygote_mod._zygote is not None and proc.pid == zygote_mod._zygote.proc.pid:
        return True
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


@pytest.fixture(autouse=True)
def _fork_local_networks_from_the_zygote(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LocalNetwork`` nodes and bootstraps fork from the worker's zygote (tests/zygote.py)
    instead of paying their imports; the `p2pdiloco demo` subprocess test still runs whole."""

    def spawn(args: list[str], log: Path, env: dict[str, str]) -> zygote_mod.Child:
        return zygote_mod.zygote().spawn(args, log, None, env, Path.cwd())

    monkeypatch.setattr(p2pdiloco.demo, "_spawn", spawn)


# Test files that start real `bootstrap`/`join` networks. They run one at a time, on one xdist
# worker (``--dist loadgroup``), as they did before xdist: two of them at once on 2 cores starve
# each other's rounds. The other worker runs everything else beside them.
NETWORK_FILES = {
    "test_gossip_resilience.py", "test_hardening_network.py", "test_join_ui.py",
    "test_network.py", "test_process_hygiene.py", "test_sync_network.py",
    "test_view_change_network.py",
}  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Real-process network tests form one xdist group, listed first so that worker starts
    on them at once. Deterministic, so every worker collects the same order."""
    for item in items:
        if item.path.name in NETWORK_FILES:
            item.add_marker(pytest.mark.xdist_group("network"))
    items.sort(key=lambda item: item.path.name not in NETWORK_FILES)
