"""No process outlives `p2pdiloco join` or `bootstrap`, however they end (ADR 0011).

Real processes on loopback: a bootstrap, a published run and a `join --no-train`. Each test
records the command's descendants (hivemind's DHT process, its p2pd, the gossip child, the
reaper), ends the command the hard way and checks that none of them is left after 10 s.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.net.manifests import create_manifest, publish_manifest
from p2pdiloco.protocol.identity import Identity
from tests.netutil import Proc, free_port, wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

_seen: list[psutil.Process] = []  # every descendant recorded by _tree, killed after the test


def _living(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:120]}"
    except psutil.Error:
        return str(p.pid)


def _tree(proc: Proc, *, gossip: bool = True) -> list[psutil.Process]:
    """The command's descendants, once its p2pd, gossip child and reaper are all up."""

    def probe() -> list[psutil.Process] | None:
        kids = psutil.Process(proc.proc.pid).children(recursive=True)
        cmds = [" ".join(k.cmdline()) for k in _living(kids)]
        need = ["p2pd", "lifeline.py"] + (["multiprocessing.spawn"] if gossip else [])
        return kids if all(any(n in c for c in cmds) for n in need) else None

    tree = wait_for(f"the children of {proc.name}", probe, timeout=90)
    _seen.extend(tree)
    return tree


def _assert_all_gone(procs: list[psutil.Process], what: str) -> None:
    t0 = time.monotonic()
    wait_for(
        f"no process left by {what}",
        lambda: not _living(procs) or None,
        timeout=10,
        interval=0.1,
    )
    print(f"\n{len(procs)} processes gone {time.monotonic() - t0:.2f} s after {what[:40]}")


def _start_bootstrap(tmp: Path) -> tuple[Proc, str]:
    proc = Proc(
        "bootstrap",
        [
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(free_port()),
            "--identity",
            str(tmp / "bootstrap.key"),
        ],
        tmp,
        fork=False,  # the whole command as a user starts it, interpreter start-up included
    )
    out = proc.wait_output("HTTP:", timeout=90)
    return proc, next(ln.strip() for ln in out.splitlines() if ln.startswith("  /ip4/"))


def _start_join(tmp: Path, addr: str) -> Proc:
    with DHTPlane(Identity.generate(), initial_peers=[addr], client_mode=True) as client:
        run_id, manifest, raw = create_manifest(
            Identity.generate(),
            name="hygiene",
            model="gemma-tiny",
            data="embedded",
            seed=0,
            inner_steps=20,
            committee_size=4,
        )
        publish_manifest(client, run_id, manifest, raw)
    proc = Proc(
        "join",
        [
            "join",
            "--run",
            run_id,
            "--bootstrap",
            addr,
            "--host",
            "127.0.0.1",
            "--no-tui",
            "--no-train",
            "--heartbeat-interval",
            "1",
        ],
        tmp,
        fork=False,
    )
    proc.wait_output(" as 12D3KooW", timeout=120)
    return proc


@pytest.fixture()
def procs() -> Iterator[list[Proc]]:
    """Commands to kill after the test, with every process of theirs seen (orphans included:
    once re-parented to init they are out of conftest's reach)."""
    started: list[Proc] = []
    try:
        yield started
    finally:
        for p in started:
            p.kill()
        strays = _living(_seen)
        for p in strays:
            p.kill()
        psutil.wait_procs(strays, timeout=10)
        _seen.clear()


def test_sigkill_leaves_no_process(tmp_path: Path, procs: list[Proc]) -> None:
    boot, addr = _start_bootstrap(tmp_path)
    procs.append(boot)
    join = _start_join(tmp_path, addr)
    procs.append(join)

    for proc in (join, boot):
        tree = _tree(proc)
        os.kill(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait(timeout=10)
        _assert_all_gone(tree, f"SIGKILL of {proc.name}: " + ", ".join(map(_describe, tree)))


def test_double_ctrl_c_and_sigterm_leave_no_process(tmp_path: Path, procs: list[Proc]) -> None:
    boot, addr = _start_bootstrap(tmp_path)
    procs.append(boot)
    join = _start_join(tmp_path, addr)
    procs.append(join)

    tree = _tree(join)
    # Ctrl-C reaches the whole process group; the second one exits at once.
    os.killpg(join.proc.pid, signal.SIGINT)
    join.wait_output("stopping cleanly", timeout=10)
    os.killpg(join.proc.pid, signal.SIGINT)
    # `--no-train` has little to save, so its clean stop may be over by now: the second Ctrl-C
    # then lands in the interpreter's exit (killed by SIGINT, which a shell shows as 130 too) or
    # after it (0). A second Ctrl-C during a slow clean stop exits 130: tests/test_signals.py.
    # The guarantee checked here is that it ends promptly and leaves no process.
    assert join.proc.wait(timeout=30) in (130, -signal.SIGINT, 0)
    _assert_all_gone(tree, "a second Ctrl-C of join: " + ", ".join(map(_describe, tree)))

    tree = _tree(boot)
    boot.proc.send_signal(signal.SIGTERM)
    boot.proc.wait(timeout=60)
    _assert_all_gone(tree, "SIGTERM of bootstrap: " + ", ".join(map(_describe, tree)))
