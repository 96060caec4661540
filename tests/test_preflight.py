"""Preflight checks and ``p2pdiloco doctor``: no model allocation, no network but loopback."""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import typer
from typer.testing import CliRunner

from p2pdiloco import preflight
from p2pdiloco.cli.doctor_cmd import doctor
from p2pdiloco.preflight import (
    Finding,
    PreflightConfig,
    auto_batch_size,
    check_bootstrap,
    check_clock,
    check_device_memory,
    check_disk,
    check_protocol,
    check_python,
    check_reachability,
    check_torch,
    run_preflight,
    worst,
)
from p2pdiloco.preflight.network import MULTISTREAM
from p2pdiloco.protocol.signing import PROTOCOL_VERSION
from p2pdiloco.train.island_plan import plan_island
from p2pdiloco.train.memory import GiB, estimate_memory
from p2pdiloco.train.models import model_names

PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def serve(answer: bytes | None) -> Iterator[int]:
    """A loopback TCP server that answers each connection's first bytes with ``answer`` (None:
    says nothing); its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()

        def accept() -> None:
            held = []
            while True:
                try:
                    conn, _ = s.accept()
                except OSError:  # the server closed
                    return
                held.append(conn)  # kept open: a silent server must stay silent, not close
                if answer is not None:
                    conn.recv(64)
                    conn.sendall(answer)

        threading.Thread(target=accept, daemon=True).start()
        yield s.getsockname()[1]


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A libp2p node's first answer: the multistream-select header."""
    yield from serve(MULTISTREAM)


@pytest.fixture
def closed_port() -> int:
    # Bound but never listening: connects are refused, and no other test can take the port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def addr(port: int, host: str = "127.0.0.1") -> str:
    return f"/ip4/{host}/tcp/{port}/p2p/{PEER}"


def test_findings_need_a_fix_when_something_is_wrong() -> None:
    with pytest.raises(ValueError, match="needs a fix"):
        Finding("disk", "error", "full")
    assert worst([]) == "ok"
    assert worst([Finding("a", "info", "x"), Finding("b", "warn", "y", "z")]) == "warn"
    assert worst([Finding("a", "error", "x", "f"), Finding("b", "ok", "y")]) == "error"


def test_python_and_torch_are_reported() -> None:
    assert check_python().severity == "ok"
    found = check_torch()
    assert [f.check for f in found] == ["torch", "driver"]
    assert found[0].severity == "ok"
    for f in found:
        assert f.detail and "\n" not in f.detail


def test_model_too_large_names_need_and_a_model_that_fits() -> None:
    f = check_device_memory(PreflightConfig(model="gemma-12b", device="cpu", max_memory_gb=24))
    assert f.check == "device memory" and f.severity == "error"
    need = estimate_memory("gemma-12b", "fp32", micro_batch=1).total
    assert f"{need / GiB:.1f} GiB" in f.detail
    assert "24 GiB" in f.detail
    named = [n for n in model_names() if n != "gemma-12b" and re.search(rf"\b{n}\b", f.fix)]
    assert named, f.fix
    assert all(estimate_memory(n, "fp32").total <= 24 * GiB for n in named)
    # 24 GiB holds no rank of a gemma-12b island: in fp32 the loss's backward alone keeps
    # 12 GiB of logits at 1×4096, beside the gathered embedding (see test_island_plan).
    assert plan_island("gemma-12b", "fp32", 24 * GiB) is None
    assert "no island of such devices holds gemma-12b" in f.fix
    f = check_device_memory(PreflightConfig(model="gemma-12b", device="cpu", max_memory_gb=48))
    plan = plan_island("gemma-12b", "fp32", 48 * GiB)  # FSDP2-sharded state
    assert plan is not None and plan.describe() in f.fix


def test_small_model_fits() -> None:
    f = check_device_memory(PreflightConfig(model="gemma-tiny", device="cpu", max_memory_gb=4))
    assert f.severity == "ok", f
    assert "gemma-tiny needs about" in f.detail


def test_memory_check_reports_bad_settings_as_findings() -> None:
    unknown = check_device_memory(PreflightConfig(model="gemma-99b", device="cpu"))
    assert unknown.severity == "error" and "gemma-99b" in unknown.detail
    gpus_on_cpu = check_device_memory(PreflightConfig(model="gemma-tiny", device="cpu", gpus=(0,)))
    assert gpus_on_cpu.severity == "error" and "--gpus" in gpus_on_cpu.detail
    assert check_device_memory(PreflightConfig()).severity == "info"


def test_explicit_batch_too_large_suggests_a_smaller_batch() -> None:
    cfg = PreflightConfig(model="gemma-small", device="cpu", max_memory_gb=4, batch_size=64)
    f = check_device_memory(cfg)
    assert f.severity == "error"
    assert "--batch-size" in f.fix


def test_auto_batch_size_is_monotonic_and_at_least_one() -> None:
    sizes = [auto_batch_size("gemma-small", "cpu", int(g * GiB)) for g in (0, 1, 2, 4, 8, 16, 64)]
    assert sizes == sorted(sizes)
    assert sizes[0] == 1 and sizes[-1] == 64
    assert all(s & (s - 1) == 0 for s in sizes)
    for s, g in zip(sizes[1:], (1, 2, 4, 8, 16, 64), strict=True):
        if s > 1:
            assert estimate_memory("gemma-small", "fp32", micro_batch=s).total <= g * GiB
        if s < 64:
            assert estimate_memory("gemma-small", "fp32", micro_batch=2 * s).total > g * GiB


def test_disk_ok_in_a_tmp_dir(tmp_path: Path) -> None:
    f = check_disk(PreflightConfig(model="gemma-tiny", state_dir=tmp_path / "not" / "yet"))
    assert f.severity == "ok", f
    assert str(tmp_path) in f.detail


class _Usage(NamedTuple):
    total: int
    used: int
    free: int


def test_disk_nearly_full_is_reported_with_a_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _: _Usage(10 * GiB, 10 * GiB - 2**20, 2**20))
    f = check_disk(PreflightConfig(model="gemma-tiny", state_dir=tmp_path))
    assert f.severity == "error"
    assert "--state-dir" in f.fix
    state = preflight.fp32_state_bytes("gemma-tiny")
    roomy = preflight.DISK_STATES * state + preflight.DISK_SLACK + 2**20
    monkeypatch.setattr(shutil, "disk_usage", lambda _: _Usage(10 * GiB, 0, roomy))
    tight = check_disk(PreflightConfig(model="gemma-tiny", state_dir=tmp_path))
    assert tight.severity == "warn" and tight.fix


def test_bootstrap_reachable(listening_port: int) -> None:
    [f] = check_bootstrap(PreflightConfig(bootstrap=(addr(listening_port),), timeout=2))
    assert f.severity == "ok", f
    assert f"127.0.0.1:{listening_port}" in f.detail


@pytest.mark.parametrize(
    "answer, needle",
    [
        (b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\n\r\n", "answered as something else"),
        (None, "said nothing within 1 s"),
    ],
)
def test_a_server_that_is_not_libp2p_is_unreachable(answer: bytes | None, needle: str) -> None:
    # A transparent proxy or firewall accepts any connection: a TCP connect alone proves
    # nothing (seen on a sandbox that answered HTTP 400 for every address).
    for port in serve(answer):
        [f] = check_bootstrap(PreflightConfig(bootstrap=(addr(port),), timeout=1))
        assert f.severity == "error" and needle in f.detail, f


def test_bootstrap_unreachable_and_malformed(closed_port: int, listening_port: int) -> None:
    bad = "/ip4/127.0.0.1/udp/9/p2p/" + PEER
    found = check_bootstrap(PreflightConfig(bootstrap=(addr(closed_port), bad), timeout=2))
    assert [f.severity for f in found] == ["error", "error"]
    assert "refused" in found[0].detail and "firewall" in found[0].fix
    assert bad in found[1].detail and found[1].fix
    # One reachable server is enough: the dead one is only a warning then.
    found = check_bootstrap(
        PreflightConfig(bootstrap=(addr(closed_port), addr(listening_port)), timeout=2)
    )
    assert [f.severity for f in found] == ["warn", "ok"]


@pytest.mark.parametrize(
    "address",
    [
        "/ip4/1.2.3/tcp/4001/p2p/" + PEER,
        "/ip4/::1/tcp/4001/p2p/" + PEER,
        "/ip4/127.0.0.1/tcp/70000/p2p/" + PEER,
        "/ip4/127.0.0.1/tcp/4001",
        "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...",
        "127.0.0.1:4001",
    ],
)
def test_malformed_addresses_are_named(address: str) -> None:
    [f] = check_bootstrap(PreflightConfig(bootstrap=(address,)))
    assert f.severity == "error" and f"'{address}'" in f.detail and f.fix


def test_no_bootstrap_explains_where_to_set_one() -> None:
    [f] = check_bootstrap(PreflightConfig())
    assert f.severity == "error"
    assert "--bootstrap" in f.fix and "P2PDILOCO_BOOTSTRAP" in f.fix and "config" in f.fix


@pytest.mark.parametrize(
    ("offset", "severity"),
    [(None, "info"), (0.0, "ok"), (-4.9, "ok"), (5.0, "warn"), (-59.0, "warn"), (60.0, "error")],
)
def test_clock_thresholds(offset: float | None, severity: str) -> None:
    f = check_clock(offset)
    assert f.severity == severity
    if severity in ("warn", "error"):
        assert "timedatectl set-ntp true" in f.fix


def test_protocol() -> None:
    assert check_protocol(PROTOCOL_VERSION).severity == "ok"
    assert check_protocol(None).severity == "info"
    newer = check_protocol(PROTOCOL_VERSION + 1)
    assert newer.severity == "error" and "upgrade" in newer.fix
    assert check_protocol(PROTOCOL_VERSION - 1).severity == "error"


def test_reachability() -> None:
    assert check_reachability("direct").severity == "ok"
    relayed = check_reachability("relayed", fix="forward TCP port 4001")
    assert relayed.severity == "warn" and relayed.fix == "forward TCP port 4001"
    assert check_reachability("relayed").fix
    assert check_reachability(None).severity == "info"
    assert check_reachability("unknown").severity == "info"
    with pytest.raises(ValueError):
        check_reachability("sideways")


def test_run_preflight_covers_every_check(tmp_path: Path, listening_port: int) -> None:
    class Reach(NamedTuple):
        status: str
        fix: str

    cfg = PreflightConfig(
        model="gemma-tiny",
        device="cpu",
        max_memory_gb=4,
        state_dir=tmp_path,
        bootstrap=(addr(listening_port),),
    )
    found = run_preflight(
        cfg,
        clock_offset=1.0,
        reachability=Reach("relayed", "open port 4001"),
        manifest_protocol=PROTOCOL_VERSION,
    )
    checks = [f.check for f in found]
    for name in ("python", "torch", "driver", "device memory", "disk", "bootstrap", "clock"):
        assert name in checks
    assert {f.check: f for f in found}["reachability"].fix == "open port 4001"
    assert worst(found) == "warn"


# ---------------------------------------------------------------------------------------------
# the command


def cli() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command()(doctor)

    @app.callback()
    def _root() -> None:  # a group, so the command is invoked by name as in the real CLI
        pass

    return app


def test_doctor_refuses_a_model_too_large(closed_port: int) -> None:
    result = CliRunner().invoke(
        cli(),
        [
            "doctor",
            *("--model", "gemma-12b", "--device", "cpu", "--max-memory", "24"),
            *("--bootstrap", addr(closed_port), "--timeout", "2"),
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    need = estimate_memory("gemma-12b", "fp32", micro_batch=1).total
    assert f"needs about {need / GiB:.1f} GiB" in result.stdout
    assert "--model gemma-small" in result.stdout  # gemma-270m needs 26.8 GiB (test_models)
    assert "unreachable" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("doctor: ")


def test_doctor_json_parses_and_passes(tmp_path: Path, listening_port: int) -> None:
    result = CliRunner().invoke(
        cli(),
        [
            "doctor",
            *("--model", "gemma-tiny", "--device", "cpu", "--max-memory", "4", "--json"),
            *("--state-dir", str(tmp_path), "--bootstrap", addr(listening_port)),
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert {f["check"] for f in found} >= {"python", "device memory", "disk", "bootstrap"}
    assert all(set(f) == {"check", "severity", "detail", "fix"} for f in found)
    assert "doctor: " in result.stderr


def test_doctor_agrees_with_itself_and_with_join(tmp_path: Path, listening_port: int) -> None:
    """A bootstrap found reachable is not followed by "needs a reachable bootstrap" (doctor does
    not join, so it cannot measure reachability; it says who does), and the auto batch it plans
    is the one join starts from, with join's cap by the run's batch said (issue 39)."""
    result = CliRunner().invoke(
        cli(),
        [
            "doctor",
            *("--model", "gemma-tiny", "--device", "cpu", "--max-memory", "4", "--json"),
            *("--state-dir", str(tmp_path), "--bootstrap", addr(listening_port)),
        ],
        env={"COLUMNS": "200"},
    )
    found = {f["check"]: f for f in json.loads(result.stdout)}
    assert found["bootstrap"]["severity"] == "ok"
    assert found["reachability"]["detail"] == (
        "not measured here: `join` asks a bootstrap server to dial it back, and prints it"
    )
    auto = auto_batch_size("gemma-tiny", "cpu", 4 * GiB)  # what join's auto starts from
    assert f"auto batch up to {auto}×" in found["device memory"]["detail"]
    assert "join takes at most the run's batch per inner step" in found["device memory"]["detail"]


@pytest.mark.parametrize("gpus", ["0,x", "-1", "0,,2", "0,0"])
def test_doctor_malformed_gpus_is_one_line(gpus: str) -> None:
    result = CliRunner().invoke(cli(), ["doctor", "--gpus", gpus], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --gpus")
    assert len(result.stderr.strip().splitlines()) == 1
