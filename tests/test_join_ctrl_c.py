"""Ctrl-C stops `p2pdiloco join` and `bootstrap` cleanly at any moment, their start included.

Real processes on loopback; SIGINT goes to the command's process group, as a terminal sends it
(so it reaches every child the command started there). The soak (bench/soak.py) saw a Ctrl-C
during a start reach the DHT daemon (`join` then failed with "cannot join the DHT … Daemon
failed to start: None"), a `join` that said "stopping cleanly" and went on joining, and a
bootstrap that logged daemon errors and a traceback at its stop.

Every stop here must: end within ``STOP_BOUND`` seconds, with exit 0 (or 130 with the one line
"interrupted" when the Ctrl-C came before the command installed its handler, while its modules
load); say it stops once; print no traceback, no `error:` and no daemon error; leave no process
behind (hivemind's DHT process and its p2pd included); and leave a state directory that loads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import NodeProc
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.runtime.chain import ChainStore
from p2pdiloco.train.local_state import load_local
from tests.netutil import Proc, wait_for
from tests.test_sync_network import SMALL

pytestmark = [pytest.mark.slow, pytest.mark.solo, pytest.mark.timeout(600)]

# A clean stop: the trainer ends after its current inner step, the runtime's tasks are
# cancelled (10 s at most) and its checkpoint writes finish (30 s at most), then the gossip
# child, the bridge and the DHT close (a few seconds each). Measured: a few seconds.
STOP_BOUND = 60.0


@dataclass
class Stopped:
    what: str
    code: int
    seconds: float
    text: str


def _living(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return _living(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def _has_p2pd(pid: int) -> bool:
    for p in _tree(pid):
        try:
            if p.name() == "p2pd":
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def _own_group(pid: int) -> bool:
    """The forked command has made its own session (tests/zygote.py): Ctrl-C can reach it."""
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _signal_state(pid: int) -> str:
    """Each thread's state and its pending and blocked signals (hex masks, SIGINT = 0x2), and
    the process's shared pending set, from /proc: whether the Ctrl-C is still pending, and in
    which thread it could be taken."""
    lines = []
    with contextlib.suppress(OSError):
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with contextlib.suppress(OSError):
                status = dict(
                    line.split(":\t", 1)
                    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
                    if ":\t" in line
                )
                wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text()
                lines.append(
                    f"  task {tid} {status.get('Name', '?').strip()}: "
                    f"{status.get('State', '?').strip()} in {wchan or '?'}, "
                    f"SigPnd {status.get('SigPnd', '?').strip()}, "
                    f"SigBlk {status.get('SigBlk', '?').strip()}, "
                    f"ShdPnd {status.get('ShdPnd', '?').strip()}"
                )
    return "\n".join(lines)


def _where(pid: int, text: Any) -> str:
    """Where a command that does not stop hangs: its threads' signal state (/proc), its
    processes, and every thread's stack, which `kill -USR1` has it print (signals.stop_event)
    to its output. The dump is read back once it stops growing: the main thread comes last
    (faulthandler lists the newest thread first), and a busy machine may write it slowly."""
    state = _signal_state(pid)
    children = []
    for p in _tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            children.append(f"{p.pid} {p.name()} ({p.status()})")
    os.kill(pid, signal.SIGUSR1)
    seen = [-1]

    def settled() -> bool:
        out = text()
        done = "most recent call first" in out and len(out) == seen[0]
        seen[0] = len(out)
        return done

    with contextlib.suppress(AssertionError):  # no dump: the output as it is
        wait_for("the whole stack dump", settled, 20, interval=1.0)
    return f"threads:\n{state}\nprocesses below it: {children}\n{text()[-12000:]}"


def ctrl_c(what: str, proc: Any, text: Any) -> Stopped:
    """SIGINT to ``proc``'s process group; its exit, how long it took, and its output once
    every process it had is gone (AssertionError naming what is left)."""
    tree = _tree(proc.pid)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        code = proc.wait(STOP_BOUND)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"{what}: still running {STOP_BOUND:.0f} s after Ctrl-C\n{_where(proc.pid, text)}"
        ) from None
    seconds = time.monotonic() - start
    wait_for(
        f"no process left by {what}: {[p.pid for p in _living(tree)]}",
        lambda: not _living(tree) or None,
        timeout=10,
        interval=0.1,
    )
    print(f"\n{what}: exit {code} after {seconds:.1f} s, {len(tree)} processes gone")
    return Stopped(what, code, seconds, text())


def assert_clean(s: Stopped, stopped_line: str) -> None:
    tail = s.text[-3000:]
    assert "Traceback" not in s.text, f"{s.what}:\n{tail}"
    assert "error:" not in s.text, f"{s.what}:\n{tail}"
    assert "[ERROR]" not in s.text, f"{s.what}: a daemon error\n{tail}"
    assert "did not shut down" not in s.text, f"{s.what}:\n{tail}"
    assert s.seconds < STOP_BOUND
    if s.code == 130:  # the Ctrl-C came while the command's modules loaded: said in one line
        assert s.text.rstrip().endswith("interrupted"), f"{s.what}:\n{tail}"
        return
    assert s.code == 0, f"{s.what}: exit {s.code}\n{tail}"
    assert s.text.count("stopping cleanly") == 1, f"{s.what}:\n{tail}"
    assert stopped_line in s.text, f"{s.what}:\n{tail}"


def assert_loads(node: NodeProc, run_id: str, progress: bool) -> None:
    """The state directory holds only finished files, and what it holds loads: the certified
    chain (nothing but genesis here: no quorum of three once two volunteers stopped) and, when
    ``progress``, the local progress saved at the stop."""
    state = node.dir / "state"
    assert not [p for p in state.rglob("*") if ".tmp" in p.name], list(state.rglob("*"))
    ChainStore(state, run_id).restore()
    assert (load_local(state, run_id) is not None) == progress


def test_ctrl_c_stops_a_join_at_any_moment_of_its_start_and_while_training(
    tmp_path: Path,
) -> None:
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(3)]
        run_id = net.publish_run(keys)
        early, joining, trainer = (
            net.start_node(name, key, until_version=100)
            for name, key in zip(("early", "joining", "trainer"), keys, strict=True)
        )

        # Right after the start: the command parses its flags and checks the machine.
        wait_for("the command's own process group", lambda: _own_group(early.proc.pid), 30)
        stops = [(ctrl_c("right after the start", early.proc, early.text), early)]
        # While joining the DHT: its p2pd has just started (a Ctrl-C that reached it made the
        # start fail), then the run lookup, gossip and reachability.
        wait_for("the DHT daemon of a joining node", lambda: _has_p2pd(joining.proc.pid), 120)
        stops.append((ctrl_c("while joining the DHT", joining.proc, joining.text), joining))
        # While training, with a committee seat (the three keys form the genesis committee).
        wait_for(
            "inner steps trained",
            lambda: trainer.status().get("tokens_trained", 0) > 0 or None,
            240,
        )
        stops.append((ctrl_c("while training", trainer.proc, trainer.text), trainer))
        # Its state directory loads again: the node starts from it and trains on.
        again = net.start_node("trainer", keys[2], until_version=100)
        wait_for(
            "the restarted node training", lambda: "training from version" in again.text(), 240
        )
        stops.append((ctrl_c("after a restart", again.proc, again.text), again))

        for s, node in stops:
            trained = "training from version" in s.text
            assert_clean(s, "stopped cleanly; kept" if trained else "stopped cleanly")
            assert_loads(node, run_id, progress=trained)
        assert "local steps not yet merged" in stops[2][0].text  # its progress was saved
        assert "resumed local progress" in stops[3][0].text


def _bootstrap(tmp: Path, name: str) -> Proc:
    return Proc(
        name,
        [
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            "0",
            "--identity",
            str(tmp / f"{name}.key"),
        ],
        tmp,
    )


def test_ctrl_c_stops_a_bootstrap_while_starting_and_while_serving(tmp_path: Path) -> None:
    starting, serving = _bootstrap(tmp_path, "starting"), _bootstrap(tmp_path, "serving")
    try:
        wait_for("the starting bootstrap's DHT daemon", lambda: _has_p2pd(starting.proc.pid), 120)
        first = ctrl_c("a bootstrap while starting", starting.proc, starting.text)
        serving.wait_output("HTTP:", timeout=120)
        second = ctrl_c("a bootstrap while serving", serving.proc, serving.text)
    finally:
        starting.kill()
        serving.kill()
    assert_clean(first, "stopping")
    assert_clean(second, "stopping")
