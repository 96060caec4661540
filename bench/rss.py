"""Peak resident memory of one call, sampled from /proc (Linux): the benches' memory figures.

Run the bench with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``, read at process
start), so a freed buffer of a megabyte or more goes back to the system and RSS is what is
live; ``bench/merge_memory.py`` and ``bench/aggregate.py`` re-execute themselves that way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


MARKER = "P2PDILOCO_FIXED_MMAP"


def rerun_with_fixed_mmap() -> int | None:
    """In the first process: run this script again with a fixed mmap threshold (each
    buffer of 1 MiB or more is its own mapping, returned to the system when freed, so RSS is
    what is live; glibc's sliding threshold would recycle freed memory on the heap and hide a
    call's own) and return its exit code. In the re-executed process: None."""
    if os.environ.get(MARKER) == "1":
        return None
    env = {**os.environ, MARKER: "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    return subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode


def rss() -> int:
    """This process's resident set size in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024


def peak_added(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn()``, and the bytes of RSS it added at its peak above the RSS before it (sampled
    every 2 ms by a thread, and once more at the end)."""
    before, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], rss())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        out = fn()
    finally:
        done.set()
        sampler.join()
    return out, max(0, max(peak[0], rss()) - before)
