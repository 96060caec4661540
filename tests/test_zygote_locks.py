"""A zygote's children do not share hivemind's import-time locks (tests/zygote.py).

Reproduces what hung CI: a child forked from a process that imported hivemind is SIGKILLed
while it holds ``MPFuture._update_lock``; a later child of the same parent must still take it
(and so start its DHT). Without ``FRESH_LOCKS`` the later child blocks for good.
"""

from __future__ import annotations

import subprocess
import sys

from tests.zygote import FRESH_LOCKS

SCRIPT = r"""
import os, signal, sys
from hivemind.utils.mpfuture import MPFuture

def fork(body):
    pid = os.fork()
    if pid == 0:
        if FRESH:
            exec(FRESH_LOCKS, {})
        body()
        os._exit(0)
    return pid

def hold_forever():
    MPFuture._update_lock.acquire()
    os.kill(os.getpid(), signal.SIGSTOP)  # parked while holding it, then killed

def take():
    os._exit(0 if MPFuture._update_lock.acquire(timeout=2) else 3)

FRESH = sys.argv[1] == "fresh"
holder = fork(hold_forever)
os.waitpid(holder, os.WUNTRACED)  # stopped, lock held
os.kill(holder, signal.SIGKILL)
os.waitpid(holder, 0)
_, status = os.waitpid(fork(take), 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run(mode: str) -> int:
    code = f"FRESH_LOCKS = {FRESH_LOCKS!r}\n{SCRIPT}"
    return subprocess.run([sys.executable, "-c", code, mode], timeout=120).returncode


def test_a_child_killed_holding_hivemind_s_lock_does_not_block_the_next_child() -> None:
    assert run("shared") == 3  # the bug: the next child cannot take the lock
    assert run("fresh") == 0  # each child with its own locks, as a fresh interpreter
