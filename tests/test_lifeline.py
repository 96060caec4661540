"""The reaper's view of a process tree (p2pdiloco.net.lifeline, ADR 0011): the per-task
``/proc`` reads it refreshes with find what a scan of the whole process table finds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from p2pdiloco.net import lifeline


@pytest.mark.skipif(not lifeline.supported(), reason="Linux /proc only")
def test_per_task_reads_and_a_table_scan_find_the_same_descendants() -> None:
    # A shell with two children, one of which has a child of its own: three levels. The
    # subshell says "ready" once its own child runs, after the first one was started.
    script = "sleep 30 & (sleep 30 & echo ready; wait) & wait"
    tree = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE)
    below: set[lifeline.Proc] = set()
    try:
        assert tree.stdout is not None and tree.stdout.readline() == b"ready\n"
        below = lifeline.descendants([tree.pid], lifeline.children_map())
        assert len(below) == 3, below
        scanned = lifeline.descendants([os.getpid()], lifeline.children_map())
        if lifeline._TASK_CHILDREN:
            assert lifeline.descendants([os.getpid()]) == scanned
        assert lifeline.identify(tree.pid) in scanned
    finally:
        lifeline.kill_all(below, grace=0.0)
        tree.kill()
        tree.wait()
        if tree.stdout is not None:
            tree.stdout.close()


# A process whose child waits on a pipe from it: the child reports whether, once the pipe
# broke, ``parent_gone`` found its parent gone (the DHT process of a SIGKILLed node).
_BROKEN_PIPE = """
import os, sys, multiprocessing as mp
from p2pdiloco.net.dht import parent_gone
r, w = mp.Pipe(duplex=False)
if os.fork() == 0:
    w.close()
    parent = os.getppid()
    print("ready", flush=True)
    try:
        r.recv()
    except (EOFError, ConnectionError):
        print("gone" if parent_gone(parent) else "alive", flush=True)
    os._exit(0)
r.close()
sys.stdin.read()
"""


@pytest.mark.skipif(not lifeline.supported(), reason="Linux /proc only")
def test_a_child_whose_parent_was_killed_mid_call_finds_it_gone() -> None:
    """The soak's only traceback: a node SIGKILLed while its DHT process read a call from it;
    the pipe broke before the DHT process was handed to a new parent. It now waits for that
    (``parent_gone``) and ends quietly; with its parent alive the error is raised as before."""
    from p2pdiloco.net.dht import parent_gone

    assert parent_gone(os.getppid(), wait=0.05) is False
    proc = subprocess.Popen(
        [sys.executable, "-c", _BROKEN_PIPE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        proc.kill()  # the parent, SIGKILLed; its child is left reading
        assert proc.stdout.readline() == b"gone\n"
    finally:
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
