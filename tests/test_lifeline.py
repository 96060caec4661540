"""The reaper's view of a process tree (p2pdiloco.net.lifeline, ADR 0011): the per-task
``/proc`` reads it refreshes with find what a scan of the whole process table finds."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from p2pdiloco.net import lifeline


@pytest.mark.skipif(not lifeline.supported(), reason="Linux /proc only")
def test_per_task_reads_and_a_table_scan_find_the_same_descendants() -> None:
    # A shell with two children, one of which has a child of its own: three levels.
    tree = subprocess.Popen(["sh", "-c", "sleep 30 & (sleep 30 & wait) & wait"])
    below: set[lifeline.Proc] = set()
    try:
        deadline = time.monotonic() + 10
        while len(below := lifeline.descendants([tree.pid], lifeline.children_map())) < 3:
            assert time.monotonic() < deadline, "the shell did not start its children"
            time.sleep(0.05)  # polling the process table, with a deadline
        scanned = lifeline.descendants([os.getpid()], lifeline.children_map())
        if lifeline._TASK_CHILDREN:
            assert lifeline.descendants([os.getpid()]) == scanned
        assert lifeline.identify(tree.pid) in scanned
    finally:
        lifeline.kill_all(below, grace=0.0)
        tree.kill()
        tree.wait()
