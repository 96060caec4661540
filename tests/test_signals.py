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
