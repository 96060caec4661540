"""SIGTERM handling: the installing process stops cleanly, forked children still die."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import multiprocessing as mp, os, signal, sys
from p2pdiloco.signals import stop_event

ctx = mp.get_context("fork")
ready = ctx.Event()

def child():
    ready.set()
    signal.pause()  # stands in for hivemind's DHT loop, until terminate()

stop = stop_event()
proc = ctx.Process(target=child, daemon=True)
proc.start()
# CPython drops signals that arrive during fork itself; hivemind terminates long after.
assert ready.wait(10)
proc.terminate()                     # what hivemind's DHT.shutdown does "the hard way"
proc.join(10)
print("child exitcode", proc.exitcode, flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # the parent only sets its event
print("parent stop set", stop.wait(5), flush=True)
"""


def test_forked_child_dies_on_terminate_and_parent_sets_event() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"child exitcode -{15}" in out.stdout
    assert "parent stop set True" in out.stdout


SECOND_CTRL_C = r"""
import os, signal, threading
from p2pdiloco.signals import stop_event

stop = stop_event()
os.kill(os.getpid(), signal.SIGINT)   # the first Ctrl-C only asks for a clean stop
assert stop.wait(5)
print("stopping", flush=True)
os.kill(os.getpid(), signal.SIGINT)   # the second one exits at once, mid-way through it
threading.Event().wait(60)            # a clean stop that would take a minute
print("not reached", flush=True)
"""


def test_a_second_ctrl_c_exits_130_at_once_during_a_slow_clean_stop() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SECOND_CTRL_C], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 130, out.stderr
    assert out.stdout.splitlines() == ["stopping"]
    assert "second Ctrl-C: exiting now" in out.stderr


STUCK_STOP = r"""
import os, signal, threading
from p2pdiloco import signals

signals.STOP_LIMIT_S = 1.0
stop = signals.stop_event()
os.kill(os.getpid(), signal.SIGTERM)  # asks for a clean stop
assert stop.wait(5)
print("stopping", flush=True)
threading.Event().wait(60)            # a clean stop that is stuck
print("not reached", flush=True)
"""


def test_a_clean_stop_that_is_stuck_exits_with_every_threads_stack() -> None:
    """A node whose stop hangs (a bug) neither runs on nor is left behind: past the limit it
    prints its threads' stacks, for the bug report, and exits 1."""
    out = subprocess.run(
        [sys.executable, "-c", STUCK_STOP], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 1, out.stderr
    assert out.stdout.splitlines() == ["stopping"]
    assert "Timeout" in out.stderr and "in <module>" in out.stderr, out.stderr


DHT_START = r"""
import os, signal
from hivemind.utils.mpfuture import MPFuture
from p2pdiloco.net.dht import _GuardedDHT
from p2pdiloco.signals import stop_event

def blocks_sigint(status):
    return bool(int(open(status).read().split("SigBlk:")[1].split()[0], 16) & (1 << 1))

os.setsid()  # a terminal's foreground group, this process its leader
stop = stop_event()
dht = _GuardedDHT(start=False)  # its first MPFuture: the reader thread and torch's shm manager
me = os.getpid()
(manager,) = [int(c) for t in os.listdir(f"/proc/{me}/task")
              for c in open(f"/proc/{me}/task/{t}/children").read().split()]
print("manager", open(f"/proc/{manager}/comm").read().strip(),
      blocks_sigint(f"/proc/{manager}/status"), flush=True)
reader = MPFuture._pipe_waiter_thread.native_id
print("reader", blocks_sigint(f"/proc/{me}/task/{reader}/status"), flush=True)
print("main", blocks_sigint(f"/proc/{me}/task/{me}/status"), flush=True)
os.killpg(me, signal.SIGINT)  # Ctrl-C: the main thread takes it, the manager lives on
print("stop set", stop.wait(5), flush=True)
os.kill(manager, 0)
print("manager alive", flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_dht_starts_torchs_shm_manager_and_hiveminds_reader_deaf_to_ctrl_c() -> None:
    """hivemind's first MPFuture in a process (made by the DHT's constructor) starts its reader
    thread and, for the future's shared byte, torch's shm manager, a child in the terminal's
    group until it calls setsid. A Ctrl-C that killed the manager there left the command
    spinning in torch's start_manager, the GIL held, the handler never run (a test saw
    "still running 60 s after Ctrl-C"). Both start with SIGINT blocked and keep it: a Ctrl-C
    reaches the main thread and the manager lives."""
    out = subprocess.run(
        [sys.executable, "-c", DHT_START], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "manager torch_shm_manag True",
        "reader True",
        "main False",
        "stop set True",
        "manager alive",
    ], out.stderr


LOCAL_NETWORK = r"""
import sys, threading
from pathlib import Path
from p2pdiloco.harness.demo_config import DemoConfig
from p2pdiloco.harness.demo import LocalNetwork

with LocalNetwork(Path(sys.argv[1]), DemoConfig(nodes=1)) as net:
    net.start_bootstrap()
    print(net.boot_proc.pid, flush=True)
    threading.Event().wait(120)       # the demo or a bench, mid-run
"""


def test_a_terminated_demo_stops_the_processes_it_started(tmp_path: Path) -> None:
    # Python's default SIGTERM ended the demo at once and left its nodes running.
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCAL_NETWORK, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    boot = int(proc.stdout.readline())
    try:
        proc.terminate()
        assert proc.wait(60) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            os.kill(boot, 0)  # stopped and reaped by the demo
    finally:
        proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(boot, signal.SIGKILL)  # left behind: the test has failed already
