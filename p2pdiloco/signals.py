"""Stop long-running commands cleanly on SIGINT/SIGTERM, at any moment, starting included.

A terminal's Ctrl-C reaches the whole foreground process group: the command and every child
it started there. The command alone decides how to stop; its children must not act on it.
So a child started under :func:`interrupts_held` (the gossip child, the reaper, hivemind's DHT
process) begins with SIGINT blocked and calls :func:`ignore_interrupts` first thing: a Ctrl-C
that came while it was starting is dropped, not a ``KeyboardInterrupt`` traceback in its start.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
from collections.abc import Iterator

# A clean stop ends within about two minutes (join's trainer, runtime, workers, gossip and
# DHT each have their bound). One that is still running this long after the first stop
# signal is stuck: every thread's stack goes to stderr, for a bug report, and the process exits
# (1), so no command is left behind; its children stop once they see it gone (``net.lifeline``).
STOP_LIMIT_S = 240.0


class Interrupted(BaseException):
    """Raised in the main thread by the first Ctrl-C or SIGTERM while a command starts
    (:meth:`Stop.interrupting`): blocking waits of a start (a DHT daemon coming up, a run
    lookup, a state download) give way at once, and the command closes what it started.
    A BaseException, as KeyboardInterrupt is: no ``except Exception`` on the way swallows it."""


class Stop(threading.Event):
    """Set by the first SIGINT or SIGTERM (see :func:`stop_event`)."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupts = False  # raise Interrupted in the main thread (only it changes this)

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """While inside (main thread only): the first stop signal raises :class:`Interrupted`
        here, instead of only setting the event for a loop that checks it; a stop that came
        before raises it on entry. For the steps of a start, which check no event."""
        if self.is_set():
            raise Interrupted
        self.interrupts = True
        try:
            yield
        finally:
            self.interrupts = False


def default_in_fork(owner: int, signum: int) -> bool:
    """For a Python-level handler installed by process ``owner``: in a child forked after it
    was installed, restore the default action, raise ``signum`` again and return True."""
    if os.getpid() == owner:
        return False
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return True


def stop_event() -> Stop:
    """An event set by the first SIGINT or SIGTERM; a second SIGINT exits at once (130), and a
    stop still under way :data:`STOP_LIMIT_S` after the first exits with every thread's stack.

    Only the installing process reacts this way. hivemind forks its DHT process after this is
    installed, and a forked child inherits Python-level handlers: there the handler restores the
    default action and re-raises, so ``terminate()`` still kills the child (otherwise the child
    ignores it and the parent waits for it forever at exit).
    """
    stop = Stop()
    owner = os.getpid()

    def handler(signum: int, _frame: object) -> None:
        if default_in_fork(owner, signum):
            return
        first = not stop.is_set()
        if not first and signum == signal.SIGINT:
            os.write(2, b"\nsecond Ctrl-C: exiting now, without saving\n")
            os._exit(130)
        if first and signum == signal.SIGINT:
            os.write(2, b"\nstopping cleanly (Ctrl-C again to exit at once)\n")
        if first:
            with contextlib.suppress(ValueError, AttributeError, RuntimeError):
                faulthandler.dump_traceback_later(STOP_LIMIT_S, exit=True)
        stop.set()
        if first and stop.interrupts:
            raise Interrupted

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    # `kill -USR1 <pid>` prints every thread's stack to stderr, for a bug report on a node that
    # does not stop (C level: it works while every Python thread is blocked). Not where stderr
    # has no file descriptor (an in-process test runner's).
    with contextlib.suppress(ValueError, AttributeError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stop


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Block SIGINT in this thread while a child process is started inside: the child inherits
    the mask (through fork and exec), so a Ctrl-C waits until it called
    :func:`ignore_interrupts`. Meanwhile another thread of this process takes the signal, or,
    with none, it is delivered on leaving."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_interrupts() -> None:
    """First thing in a child started under :func:`interrupts_held`: ignore Ctrl-C (its parent
    decides when it stops) and drop one that came while it started (a pending signal that is
    ignored is discarded), then unblock it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
