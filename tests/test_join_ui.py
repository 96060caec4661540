"""What a volunteer sees: the dashboard in a real terminal, a clean Ctrl-C, and resuming.

One bootstrap server and one `p2pdiloco join` (the run's whole committee) on loopback; the
join runs in a pseudo-terminal, as in a volunteer's shell.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import DemoConfig, NodeProc
from p2pdiloco.protocol.identity import Identity
from tests.netutil import run_cli as forked_cli
from tests.netutil import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def read_until(fd: int, proc: subprocess.Popen[bytes], needles: list[str], timeout: float) -> str:
    """Read the terminal until every needle has appeared (ANSI codes stripped)."""
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                buf += os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
        text = ANSI.sub(b"", buf).decode(errors="replace")
        if all(n in text for n in needles):
            return text
        if proc.poll() is not None and not ready:
            break
    text = ANSI.sub(b"", buf).decode(errors="replace")
    stacks = ""
    if proc.poll() is None:  # stuck: every thread's stack (join registers SIGUSR1 for it)
        os.kill(proc.pid, signal.SIGUSR1)
        end, raw = time.monotonic() + 3.0, b""
        while time.monotonic() < end:
            if select.select([fd], [], [], 0.5)[0]:
                raw += os.read(fd, 65536)
        stacks = ANSI.sub(b"", raw).decode(errors="replace")
        stacks = "\nthreads:\n" + stacks[stacks.find("Thread 0x") :][-12000:]
    raise AssertionError(f"never saw {needles}; terminal said:\n{text[-3000:]}{stacks}")


def volunteer_version(state: Path) -> int:
    try:
        return int(json.loads((state / "status.json").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return -1


def alive(node: NodeProc) -> bool:
    assert node.proc.poll() is None, node.log_tail()
    return True


def test_dashboard_in_a_terminal_then_ctrl_c_saves_and_join_resumes(tmp_path: Path) -> None:
    with LocalNetwork(
        tmp_path, DemoConfig(inner_steps=8, grace=20.0, batch_size=4, seq_len=64)
    ) as net:
        net.start_bootstrap()
        key = Identity.generate()
        run_id = net.publish_run([key])
        node_dir = tmp_path / "volunteer"
        node_dir.mkdir()
        key.save(node_dir / "identity.key")
        state = node_dir / "state"
        args = [
            sys.executable,
            "-m",
            "p2pdiloco",
            "join",
            "--run",
            run_id,
            "--bootstrap",
            net.boot_addr,
            "--identity",
            str(node_dir / "identity.key"),
            "--host",
            "127.0.0.1",
            "--state-dir",
            str(state),
            "--threads",
            "1",
            "--heartbeat-interval",
            "2",
        ]
        env = {**os.environ, "XDG_DATA_HOME": str(node_dir), "COLUMNS": "100", "LINES": "40"}
        master, slave = pty.openpty()
        proc = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        try:
            screen = read_until(
                master, proc, ["training", "Your contribution", "Network", "version"], 180
            )
            assert "p2pdiloco join" in screen and "Traceback" not in screen
            # Let it certify a version, then a first Ctrl-C.
            wait_for("version 1", lambda: volunteer_version(state) >= 1, 180)
            os.kill(proc.pid, signal.SIGINT)
            tail = read_until(master, proc, ["stopped cleanly"], 120)
            assert proc.wait(60) == 0
            assert "kept certified version" in tail and "local steps" in tail
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            os.close(master)
        assert (state / "local.pt").exists()
        saved_version = json.loads((state / "status.json").read_text())["version"]

        # The next join resumes: certified version from disk, then the local progress on it.
        again = net.start_node("volunteer", key, until_version=saved_version + 1)
        wait_for(
            "the resume", lambda: alive(again) and "resumed local progress" in again.text(), 180
        )
        text = again.text()
        assert f"resuming from certified version {saved_version}" in text
        assert "resumed local progress" in text
        net.wait_versions(saved_version + 1, [again], 180)


def test_metrics_port_and_json_logs(tmp_path: Path) -> None:
    import urllib.request

    from tests.netutil import free_port

    with LocalNetwork(
        tmp_path, DemoConfig(inner_steps=8, grace=20.0, batch_size=4, seq_len=64)
    ) as net:
        net.start_bootstrap()
        keys = [Identity.generate(), Identity.generate()]
        net.publish_run(keys)
        port = free_port()
        node = net.start_node(
            "n0", keys[0], until_version=1, extra=["--json-logs", "--metrics-port", str(port)]
        )
        other = net.start_node("n1", keys[1], until_version=1)
        net.wait_versions(1, [node, other], 240)

        def scrape() -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return r.read().decode()
            except OSError:
                return None

        text = wait_for("metrics", scrape, 30)
        values = {
            ln.split()[0]: float(ln.split()[1])
            for ln in text.splitlines()
            if ln.startswith("p2pdiloco_") and " " in ln
        }
        assert values["p2pdiloco_version"] >= 1
        assert values["p2pdiloco_tokens_trained_total"] > 0
        assert values["p2pdiloco_deltas_accepted_total"] >= 1
        assert values["p2pdiloco_bytes_sent_total"] > 0
        assert "p2pdiloco_peers" in text

        # The leaderboard over the network: certificates fetched from the nodes, verified.
        out = forked_cli("status", "--leaderboard", "--bootstrap", net.boot_addr, "--json")
        assert out.returncode == 0, out.stderr[-3000:]
        board = json.loads(out.stdout)
        assert board["versions"] >= 1 and board["ignored"] == []
        assert {p["peer_id"] for p in board["peers"]} <= {k.peer_id for k in keys}
        assert board["peers"] and board["peers"][0]["tokens"] > 0

        lines = [ln for ln in node.text().splitlines() if ln.startswith("{")]
        records = [json.loads(ln) for ln in lines]
        assert any(r.get("logger", "").startswith("p2pdiloco") for r in records)
        assert any("version" in r and "state" in r for r in records)  # dashboard snapshots
