"""Shared fixtures: offline hub, and no child process outlives its test."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import p2pdiloco.harness.demo
import tests.zygote as zygote_mod
from tests import gossip_zygote
from tests.turns import Turns

# Tests never touch the network: the hub is off for transformers/huggingface_hub/datasets.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _is_infrastructure(proc: psutil.Process) -> bool:
    """Process-wide helpers that outlive tests by design: killing them breaks later tests
    (torch aborts on its next shared-memory allocation once its manager is gone), and this
    worker's zygote (tests/zygote.py; the commands it forked are not spared) and the zygote's
    gossip zygote (tests/gossip_zygote.py; the gossip children it forked are not spared)."""
    if zygote_mod._zygote is not None and proc.pid == zygote_mod._zygote.proc.pid:
        return True
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    if gossip_zygote.MARK in cmd:  # the zygote's gossip zygote, not the children it forks
        zygote = zygote_mod._zygote
        with contextlib.suppress(psutil.Error):
            return zygote is not None and proc.ppid() == zygote.proc.pid
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


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread_per_worker() -> Iterator[None]:
    """Under xdist the two workers share the 2 cores: torch's default of a thread per core
    would put four busy threads on them beside the other worker's networks (in-process
    simulations took 46-100 s in a full run that take 9 s alone). Tests that measure across
    thread counts set theirs explicitly."""
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        import torch

        torch.set_num_threads(1)
        # ... and so do the commands the tests start (`python -m p2pdiloco simulate`, the
        # demo's parent): OpenMP threads spin while they wait for a busy core.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    yield


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
    instead of paying their imports (the demo test too: it runs the `demo` command in process)."""

    def spawn(args: list[str], log: Path, env: dict[str, str]) -> zygote_mod.Child:
        return zygote_mod.zygote().spawn(args, log, None, env, Path.cwd())

    monkeypatch.setattr(p2pdiloco.harness.demo, "_spawn", spawn)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Solo tests (training networks, whole committees in process) first, other slow tests
    last, short ones between, each group in collection order. ``--dist worksteal`` hands each
    worker a contiguous half of this list: one worker runs the solo tests one after another
    while the other runs short tests, then the other slow ones (single nodes, DHT-only
    networks, in-process committees that assert guarantees: they run beside a solo test as a
    short test does).
    Once a worker's queue is empty it steals from the end of the other's, and
    ``pytest_runtest_protocol`` keeps two solo tests from running at once (ADR 0015).
    Deterministic, so every worker agrees."""

    def group(item: pytest.Item) -> int:
        if item.get_closest_marker("solo") is not None:
            return 0
        return 2 if item.get_closest_marker("slow") is not None else 1

    items.sort(key=group)


_turns: Turns | None = None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Under xdist, a solo test runs only while no other worker runs one (tests/turns.py). The
    turn is taken outside pytest-timeout's timer, which counts the test itself."""
    global _turns
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    off = os.environ.get("P2PDILOCO_TEST_TURNS") == "0"  # to measure a run without turns
    if item.get_closest_marker("solo") is None or run is None or off:
        yield
        return
    if _turns is None:
        lock = Path(tempfile.gettempdir()) / f"p2pdiloco-slow-tests-{run}.lock"
        _turns = Turns(lock, os.environ.get("PYTEST_XDIST_WORKER", "main"))
    with _turns.turn():
        yield
