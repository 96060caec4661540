"""Helpers for network tests: real `p2pdiloco` processes on loopback, waits with deadlines."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tests.zygote import zygote

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.25) -> T:
    """Poll ``probe`` until it returns something truthy; AssertionError naming ``what`` if not."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        # Bounded back-off between polls of a real network (not a synchronisation sleep).
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


class Proc:
    """A `python -m p2pdiloco ...` child with its output in files under ``workdir``."""

    def __init__(
        self,
        name: str,
        args: list[str],
        workdir: Path,
        env: dict[str, str] | None = None,
        *,
        fork: bool = True,
    ):
        """``fork``: fork the command from the worker's pre-imported zygote (tests/zygote.py);
        False runs ``python -m p2pdiloco`` itself, start-up included."""
        self.name = name
        self.out = workdir / f"{name}.out"
        self.err = workdir / f"{name}.err"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_DATA_HOME": str(workdir / name)}
        full_env.update(env or {})
        self.proc: Any
        if fork:
            self.proc = zygote().spawn(args, self.out, self.err, full_env, Path.cwd())
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "p2pdiloco", *args],
            stdout=open(self.out, "w"),  # noqa: SIM115 (closed with the process)
            stderr=open(self.err, "w"),  # noqa: SIM115
            env=full_env,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def wait_output(self, needle: str, timeout: float) -> str:
        def probe() -> str | None:
            if needle in (t := self.text()):
                return t
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{t[-3000:]}")
            return None

        return wait_for(f"'{needle}' from {self.name}", probe, timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (p2pd daemons and DHT children included)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM and wait; kills the group if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        # Children of a cleanly stopped process must not linger either.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return int(self.proc.returncode)


def peers_of(state: dict[str, Any], run_id: str) -> set[str]:
    return {p["peer_id"] for p in state["peers"] if p["run_id"] == run_id}


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``python -m p2pdiloco ARGS`` to its end, as ``subprocess.run(capture_output=True,
    text=True)`` returns it, but forked from the worker's zygote (tests/zygote.py): the same
    entry point, output and exit code without ~4 CPU-s of imports per command (57 commands:
    240 CPU-s of a full run). Start-up itself runs in fresh interpreters (test_cli_startup,
    test_process_hygiene, test_join_ui's terminal)."""
    with tempfile.TemporaryDirectory(prefix="p2pdiloco-cli-") as d:
        out, err = Path(d) / "out", Path(d) / "err"
        child = zygote().spawn(
            list(args), out, err, dict(os.environ if env is None else env), Path.cwd()
        )
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait(30)
            raise
        with contextlib.suppress(ProcessLookupError):  # nothing it started may linger
            os.killpg(child.pid, signal.SIGKILL)
        return subprocess.CompletedProcess(
            [sys.executable, "-m", "p2pdiloco", *args],
            code,
            out.read_text(errors="replace"),
            err.read_text(errors="replace"),
        )
