"""Stop long-running commands cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import faulthandler
import os
import signal
import threading


def default_in_fork(owner: int, signum: int) -> bool:
    """For a Python-level handler installed by process ``owner``: in a child forked after it
    was installed, restore the default action, raise ``signum`` again and return True."""
    if os.getpid() == owner:
        return False
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return True


def stop_event() -> threading.Event:
    """An event set by the first SIGINT or SIGTERM; a second SIGINT exits at once.

    Only the installing process reacts this way. hivemind forks its DHT process after this is
    installed, and a forked child inherits Python-level handlers: there the handler restores the
    default action and re-raises, so ``terminate()`` still kills the child (otherwise the child
    ignores it and the parent waits for it forever at exit).
    """
    stop = threading.Event()
    owner = os.getpid()

    def handler(signum: int, _frame: object) -> None:
        if default_in_fork(owner, signum):
            return
        if stop.is_set() and signum == signal.SIGINT:
            os.write(2, b"\nsecond Ctrl-C: exiting now, without saving\n")
            os._exit(130)
        if signum == signal.SIGINT:
            os.write(2, b"\nstopping cleanly (Ctrl-C again to exit at once)\n")
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    # `kill -USR1 <pid>` prints every thread's stack to stderr, for a bug report on a node that
    # does not stop (C level: it works while every Python thread is blocked).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stop
