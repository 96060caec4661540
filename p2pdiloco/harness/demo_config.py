"""What ``p2pdiloco demo`` is asked for (``DemoConfig``) and the node processes it starts
(``NodeProc``): what the demo, its summary, the Sybil flood and the network tests share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pdiloco.protocol.identity import Identity


@dataclass
class DemoConfig:
    nodes: int = 4  # training nodes (each a learner; the committee is drawn from them)
    rounds: int = 3  # outer rounds: each syncs every fragment once (rounds × fragments versions)
    fragments: int = 1  # Streaming DiLoCo fragments P (sync.fragments); H must be a multiple
    model: str = "gemma-tiny"
    inner_steps: int = 20  # H
    adversary: str | None = None  # the last node attacks with this kind
    aggregation: str = "median"  # as `run create` signs (ADR 0039)
    clone_factor: float | None = 0.25  # clone folding (ADR 0036), as `run create` signs
    compression: str = "int8"
    update_compression: str = "int8"  # the certified update's codec (ADR 0029), as `run create`
    committee_size: int = 4
    outer_lr: float = 0.7
    outer_momentum: float = 0.5  # short runs: ADR 0006
    inner_lr: float = 4e-4
    batch_size: int = 8
    seq_len: int = 128
    # Round timing, written into the manifest's rules (every syncer follows the run's).
    grace: float = 60.0  # a round closes at 60 % of learners, or after this many seconds
    agree_timeout: float = 15.0  # seconds without a proposal before the next syncer leads
    timeout: float = 900.0  # whole demo
    workdir: Path | None = None  # keep logs and states here (default: a temporary directory)
    # Share of wall time each node trains (join --compute-share): 1 trains on all the time, as
    # a volunteer's GPU would; below 1 leaves the cores to the rounds (the tests' networks).
    compute_share: float = 1.0
    eval_batches: int = 8

    @property
    def versions(self) -> int:
        """Certified versions to reach: every round syncs each fragment once."""
        return self.rounds * self.fragments


@dataclass
class NodeProc:
    name: str
    identity: Identity
    dir: Path
    proc: subprocess.Popen[bytes]
    adversary: str | None = None
    log: Path | None = None

    def status(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.dir / "state" / "status.json").read_text()))
        except (OSError, ValueError):
            return {}

    def kill(self) -> None:
        """SIGKILL the node's whole process group, as a crash would; its DHT process and p2pd,
        in their own group, stop once they see it gone (``net.lifeline``)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def exit_code(self, timeout: float) -> int:
        """The node's exit code once it ends within ``timeout``. A node still running then is a
        bug: every thread's stack (``kill -USR1``, registered by ``join``) goes into the error
        with its log's tail, and the node is killed, so no test leaves it behind."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            before = len(self.text())
            os.kill(self.proc.pid, signal.SIGUSR1)
            # faulthandler writes it at once ("Thread 0x…" or "Current thread 0x…" first)
            deadline = time.monotonic() + 5.0
            while "hread 0x" not in self.text()[before:] and time.monotonic() < deadline:
                time.sleep(0.1)
            text = self.text()
            self.kill()
            raise AssertionError(
                f"{self.name} still running {timeout:.0f} s on; its log:\n"
                f"{text[max(0, before - 3000) : before]}\nthreads:\n{text[before:][-12000:]}"
            ) from None

    def text(self) -> str:
        try:
            return (self.log or self.dir / "node.log").read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.log or self.dir / "node.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""
