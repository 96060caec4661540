"""Starting and stopping the gossip child: the spawn details :mod:`p2pdiloco.net.gossip` needs.

Stdlib only, like its caller: the child's entry point lives here, so ``spawn`` pickles a
reference to this module, which the child imports before py-libp2p (and never hivemind).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from p2pdiloco.net import lifeline
from p2pdiloco.signals import ignore_interrupts, interrupts_held

_main_lock = threading.Lock()


def child_entry(
    conn: Connection, seed: bytes, listen_host: str, port: int, topics: list[str], parent: int
) -> None:
    # Runs in the spawned child. The import happens here, never in the parent.
    # Ctrl-C reaches the whole process group: the parent decides when gossip stops.
    ignore_interrupts()
    lifeline.watch_parent(parent)
    if "hivemind" in sys.modules:  # py-libp2p cannot load next to it (ADR 0001)
        raise RuntimeError("hivemind was imported into the gossip child; it must not be")
    from p2pdiloco.net.gossip_host import run_child

    run_child(conn, seed, listen_host, port, topics)


@contextlib.contextmanager
def no_main_reimport() -> Iterator[None]:
    """Keep ``spawn`` from re-running the parent's ``__main__`` in the child.

    ``spawn`` re-imports the parent's main module in the child (by path, or by name for
    ``python -m``). For a console script such as ``p2pdiloco`` that would pull the whole CLI,
    hivemind included, into the gossip child, where hivemind must never be imported. The
    child needs nothing from ``__main__`` (its target lives in this module), so the main
    module's ``__spec__``/``__file__`` are hidden for the instant of ``Process.start()``.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    with _main_lock:
        missing = object()
        saved = {k: main.__dict__.get(k, missing) for k in ("__spec__", "__file__")}
        try:
            main.__spec__ = None
            main.__dict__.pop("__file__", None)
            yield
        finally:
            for k, v in saved.items():
                if v is missing:
                    main.__dict__.pop(k, None)
                else:
                    main.__dict__[k] = v


def start_child(
    seed: bytes, listen_host: str, port: int, topics: list[str], parent: int
) -> tuple[Any, Connection]:
    """A new gossip child (a fresh interpreter: ``spawn``) and this side of its pipe: the
    process has ``pid``, ``sentinel``, ``exitcode``, ``join``, ``is_alive``, ``terminate`` and
    ``kill``. The test harness forks it from a pre-imported process instead (tests/
    gossip_zygote.py), through this one name."""
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    args = (child_conn, seed, listen_host, port, topics, parent)
    proc = ctx.Process(target=child_entry, args=args, name="p2pdiloco-gossip", daemon=True)
    # Blocked until the child ignores it: a Ctrl-C during the new interpreter's start would
    # end it with a KeyboardInterrupt traceback.
    with no_main_reimport(), interrupts_held():
        proc.start()
    child_conn.close()  # so that the child's death reads as EOF on the parent's end
    return proc, parent_conn


def stop_child(proc: Any, timeout: float) -> None:
    """Wait ``timeout`` seconds for ``proc`` to exit, then terminate it, then kill it."""
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(2.0)
    if proc.is_alive():
        proc.kill()
        proc.join(2.0)
