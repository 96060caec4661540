"""A pre-imported Python that forks `p2pdiloco` commands for the network tests (ADR 0015).

Every `python -m p2pdiloco join` spends about 5 s of CPU importing torch, transformers and
hivemind before it does anything, and the network tests start about a hundred of them. The
zygote imports those once per test worker and forks each command from there. The child is a
real process: its own pid and session, its own p2pd daemon, DHT process and gossip child,
running `p2pdiloco`'s own main with the given argv, environment and working directory, its
output in files, ended by signals like any other. Only the imports are shared (hivemind forks
its DHT process from the same state in production). The CLI's own start-up stays tested by the
tests that run `python -m p2pdiloco` (test_cli, test_process_hygiene, ...).

``spawn`` returns a ``Child`` with the part of ``subprocess.Popen`` the tests use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

# Runs in each forked child first. hivemind makes process-shared semaphores at import
# (MPFuture's update and initialization locks, its executor lock): children of one zygote would
# share them, and a child SIGKILLed while holding one (the kill tests) blocked every later child
# in its DHT start-up, for good. A fresh interpreter makes its own, so each child does too.
FRESH_LOCKS = r"""
import multiprocessing as _mp
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.mpfuture import MPFuture
MPFuture.reset_backend()
_AsyncContextWrapper.EXECUTOR_LOCK = _mp.Lock()
"""

# Runs in the zygote: import once, then fork one child per request line on stdin.
SERVER = r"""
import atexit, json, os, runpy, signal, sys, threading
import p2pdiloco.cli.app, p2pdiloco.cli.join_cmd, p2pdiloco.cli.bootstrap_cmd
import p2pdiloco.runtime.launch, p2pdiloco.train.models
import tests.gossip_zygote; tests.gossip_zygote.install()  # gossip children forked too
import transformers.models.gemma.modeling_gemma

out = os.fdopen(os.dup(1), "w", buffering=1)
lock = threading.Lock()

def say(msg):
    with lock:
        out.write(json.dumps(msg) + "\n")

def child(req):
    # As a command typed at a terminal has it: a Ctrl-C raises KeyboardInterrupt until the
    # command installs its own handler. A runner started in the background (`make test &`, a
    # CI step) hands the zygote SIGINT ignored, which Python keeps: a Ctrl-C that came before
    # the handler was then dropped, and the command ran on. Set before the child has its own
    # group, so no Ctrl-C sent to that group finds it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    code = 0
    try:  # a Ctrl-C from here on ends this child (130), never runs the zygote's loop in it
        exec(FRESH_LOCKS, {})
        fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT, 0o644)  # made empty by spawn()
        efd = fd if req["err"] is None else os.open(req["err"], os.O_WRONLY | os.O_CREAT, 0o644)
        nul = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nul, 0); os.dup2(fd, 1); os.dup2(efd, 2)
        os.chdir(req["cwd"])
        os.environ.clear(); os.environ.update(req["env"])
        # The other dispositions are those of a fresh interpreter (SIGPIPE ignored so a closed
        # socket raises BrokenPipeError, the rest default): the child keeps them, as
        # `python -m p2pdiloco` would have them.
        sys.argv = ["p2pdiloco", *req["args"]]
        runpy.run_module("p2pdiloco", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        import traceback; traceback.print_exc(); code = 1
    try:
        threading._shutdown()  # what interpreter exit does: join non-daemon threads, then atexit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)

def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            threading.Event().wait(0.05)
            continue
        say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

threading.Thread(target=reap, daemon=True).start()
say({"ready": os.getpid()})
for line in sys.stdin:
    req = json.loads(line)
    with lock:  # no fork while the reaper writes
        pid = os.fork()
    if pid == 0:
        child(req)
    say({"started": pid})
"""


class Child:
    """A forked command: pid, poll(), wait(), returncode, send_signal(), kill()."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"p2pdiloco (pid {self.pid})", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


class Zygote:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"FRESH_LOCKS = {FRESH_LOCKS!r}\n{SERVER}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()
        self._started: list[int] = []
        self._cond = threading.Condition()
        self._children: dict[int, Child] = {}
        self._early: dict[int, int] = {}  # exits reported before their start
        threading.Thread(target=self._read, daemon=True).start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready, timeout=120):
                raise RuntimeError("the test zygote did not start")

    _ready = False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "ready" in msg:
                    self._ready = True
                elif "started" in msg:
                    self._started.append(msg["started"])
                elif "exit" in msg:
                    child = self._children.get(msg["exit"])
                    if child is None:
                        self._early[msg["exit"]] = msg["code"]
                    else:
                        child._exited(msg["code"])
                self._cond.notify_all()

    def spawn(
        self, args: list[str], out: Path, err: Path | None, env: dict[str, str], cwd: Path
    ) -> Child:
        req = {
            "args": args,
            "out": str(out),
            "err": None if err is None else str(err),
            "env": env,
            "cwd": str(cwd),
        }
        for path in (out, err):  # there, empty, before spawn returns (as with Popen)
            if path is not None:
                path.write_bytes(b"")
        with self._lock:
            assert self.proc.stdin is not None and self.proc.poll() is None
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            with self._cond:
                if not self._cond.wait_for(lambda: self._started, timeout=60):
                    raise RuntimeError("the test zygote did not fork")
                child = Child(self._started.pop(0), self)
                self._children[child.pid] = child
                if child.pid in self._early:
                    child._exited(self._early.pop(child.pid))
        return child


_zygote: Zygote | None = None
_zlock = threading.Lock()


def zygote() -> Zygote:
    """This test worker's zygote, started on first use."""
    global _zygote
    with _zlock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = Zygote()
        return _zygote
