"""The reaper's view of a process tree (p2pdiloco.net.lifeline, ADR 0011): the per-task
``/proc`` reads it refreshes with find what a scan of the whole process table finds."""

from __future__ import annotations

import os
import subprocess

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
