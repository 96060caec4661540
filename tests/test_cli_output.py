"""Output a person reads: tables that fit 80 and 40 columns, one peer-id form, and the stable
``--json`` keys of docs/cli.md."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console, RenderableType

from p2pdiloco.cli.status_cmd import STATE_KEYS
from p2pdiloco.dashboard.layout import Column, fitted_table, short_peer_id
from p2pdiloco.dashboard.status import leaderboard_view, status_view
from p2pdiloco.dashboard.tables import (
    demo_summary,
    findings_view,
    models_table,
    simulation_summary,
)
from tests.netutil import run_cli as forked_cli

PEERS = [
    "12D3KooWQx5f8hVbRZzLwM3tYc9p2NkJr7sA1eGdUoHvXy4iTqBm",
    "12D3KooWJPTkcrmyq9NtXimXKSf1EbQji3wzwZoR6SVtrFt8Td2t",
]


def render(view: RenderableType, width: int) -> list[str]:
    console = Console(width=width, file=io.StringIO(), color_system=None, legacy_windows=False)
    console.print(view)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b" not in out
    return [line.rstrip() for line in out.splitlines()]


def fits(lines: list[str], width: int) -> None:
    too_long = [line for line in lines if cell_len(line) > width]
    assert not too_long, "\n".join(lines)


def test_short_peer_id_is_the_tail() -> None:
    assert short_peer_id(PEERS[0]) == "…Xy4iTqBm"
    assert short_peer_id("learner-1") == "learner-1"  # short names stay whole


def test_fitted_table_drops_highest_first_then_shrinks_free_text() -> None:
    cols = [Column("id"), Column("name", shrink=True), Column("a", drop=1), Column("b", drop=2)]
    rows = [["x" * 10, "n" * 30, "a" * 10, "b" * 10]]
    wide = render(fitted_table(cols, rows, 80), 80)
    assert "b" * 10 in wide[-1] and "n" * 30 in wide[-1]
    narrow = render(fitted_table(cols, rows, 34), 34)
    fits(narrow, 34)
    assert "a" * 10 in narrow[-1] and "b" * 10 not in narrow[-1]
    assert "x" * 10 in narrow[-1] and "…" in narrow[-1]


def state() -> dict[str, Any]:
    runs = [
        {
            "run_id": "ab" * 32,
            "name": "a-rather-long-community-run-name-2026",
            "model": "gemma-270m",
            "peers": 12,
            "latest_version": 1234,
            "throughput_tps": 123456.0,
            "incompatible": "",
        },
        {
            "run_id": "cd" * 32,
            "name": "[red]spoof\x1b[2J",
            "model": "gemma-tiny",
            "peers": 1,
            "latest_version": 0,
            "throughput_tps": 0.0,
            "incompatible": "protocol 3: upgrade p2pdiloco to join this run",
        },
    ]
    peers = [
        {
            "peer_id": pid,
            "run_id": "ab" * 32,
            "island": "a-very-long-island-name-from-a-peer",
            "reachability": "relayed",
            "version": 1234,
            "throughput_tps": 2048.0,
            "last_seen_s": 12.0,
        }
        for pid in PEERS
    ]
    return {"time": 0.0, "runs": runs, "peers": peers, "bootstraps": [{}], "rejected_records": []}


def board() -> dict[str, Any]:
    return {
        "run_id": "ab" * 32,
        "run_name": "community-run",
        "versions": 42,
        "total_tokens": 3_000_000,
        "peers": [
            {
                "rank": i + 1,
                "peer_id": p,
                "accepted": 40,
                "rejected": 2,
                "tokens": 1_500_000,
                "share": 0.5,
                "last_version": 42,
            }
            for i, p in enumerate(PEERS)
        ],
        "ignored": [],
    }


@pytest.mark.parametrize("width", [80, 40])
def test_status_fits_and_keeps_key_columns(width: int) -> None:
    lines = render(status_view(state(), width), width)
    fits(lines, width)
    text = "\n".join(lines)
    for needle in ("abababababab", "peers", "version", "1234", *map(short_peer_id, PEERS)):
        assert needle in text, text
    assert "[red]" in text  # a peer's name is text, not markup
    assert PEERS[0] not in text  # one short form, never the full id
    if width == 80:
        for needle in ("gemma-270m", "tokens/s", "2048", "relayed", "12s ago"):
            assert needle in text, text


@pytest.mark.parametrize("width", [80, 40])
def test_leaderboard_fits(width: int) -> None:
    lines = render(leaderboard_view(board(), width), width)
    fits(lines, width)
    text = "\n".join(lines)
    for needle in ("rank", "1,500,000", "50.0%", *map(short_peer_id, PEERS)):
        assert needle in text, text
    assert ("last version" in text) == (width == 80)


@pytest.mark.parametrize("width", [80, 40])
def test_models_table_fits(width: int) -> None:
    from p2pdiloco.cli.models_cmd import describe_models
    from p2pdiloco.train.memory import PRECISIONS, estimate_memory

    lines = render(models_table(describe_models(list(PRECISIONS)), list(PRECISIONS), width), width)
    fits(lines, width)
    text = "\n".join(lines)
    largest = f"{estimate_memory('gemma-27b', 'fp32').total / 2**30:.1f}"  # 857.4 GiB
    for needle in ("gemma-tiny", "gemma-27b", "11.77B", "fp32", "bf16-mixed", largest):
        assert needle in text, text
    if width == 80:
        assert "bf16 " in text.splitlines()[1] + " " and "62×5376" in text


def method(tokens: int) -> dict[str, Any]:
    return {
        "eval_loss_initial": 5.6123,
        "eval_loss_final": 2.9612,
        "tokens": tokens,
        "wire_bytes": 123456789,
        "syncs": 10,
        "tokens_per_second": 2048.0,
    }


@pytest.mark.parametrize("width", [80, 40])
def test_simulation_and_demo_summaries_fit(width: int) -> None:
    result = {
        "model": "gemma-tiny",
        "parameters": 1_020_000,
        "device": "cpu",
        "learners": 4,
        "inner_steps": 20,
        "rounds": 10,
        "fragments": 1,
        "diloco": method(655360),
        "baseline": method(655360),
        "loss_ratio": 1.0,
        "bytes_ratio": 20.0,
        "corpus": {
            "source": "embedded",
            "documents": 6,
            "train_sequences": 100,
            "eval_sequences": 10,
            "tokenizer": "byte",
            "fingerprint": "f" * 64,
        },
    }
    lines = render(simulation_summary(result, width), width)
    fits(lines, width)
    assert all(s in "\n".join(lines) for s in ("DiLoCo", "data-parallel", "5.6123", "2.9612"))
    demo = {
        "run_id": "ab" * 32,
        "seconds": 95.0,
        "loss_start": 5.61,
        "loss_end": 2.96,
        "versions": 5,
        "committee": {"1": ["node0", "node1", PEERS[1]]},
        "peers": {
            f"node{i}": {
                "peer_id": p,
                "adversary": "sign-flip" if i else None,
                "accepted": 5,
                "rejected": i,
                "tokens": 81920,
            }
            for i, p in enumerate(PEERS)
        },
    }
    lines = render(demo_summary(demo, width), width)
    fits(lines, width)
    text = "\n".join(lines)
    assert all(s in text for s in ("node0", "node1", short_peer_id(PEERS[1]), "5.610"))


@pytest.mark.parametrize("width", [80, 40])
def test_doctor_findings_fit(width: int) -> None:
    findings = [
        {"check": "python", "severity": "ok", "detail": "3.11.7", "fix": ""},
        {
            "check": "disk",
            "severity": "error",
            "detail": "/a/long/state/[dir] has 0.1 GiB free; gemma-270m needs 3.2 GiB",
            "fix": "free space, or pass --state-dir on a bigger disk",
        },
    ]
    lines = render(findings_view(findings, width), width)
    fits(lines, width)
    text = "\n".join(lines)
    for needle in ("python", "disk", "error", "/a/long/state/[dir]", "--state-dir", "3.2 GiB"):
        assert needle in text, text


# ---------------------------------------------------------------- the CLI's --json, end to end


def run_cli(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns), "HF_HUB_OFFLINE": "1"}
    return forked_cli(*args, env=env, timeout=120)


@contextlib.contextmanager
def fake_bootstrap_api(body: dict[str, Any]) -> Iterator[str]:
    """A bootstrap's HTTP API on a loopback port 0, answering ``/api/v1/state`` with ``body``."""
    payload = json.dumps(body).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            ok = self.path == "/api/v1/state"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(payload if ok else b"not found")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_status_api_json_keys_and_narrow_table() -> None:
    body = {**state(), "server": {"peer_id": PEERS[1]}}
    with fake_bootstrap_api(body) as url:
        out = run_cli("status", "--api", url, "--json")
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert set(STATE_KEYS) <= set(got) and got["runs"][0]["run_id"] == "ab" * 32
        narrow = run_cli("status", "--api", url, columns=40)
        assert narrow.returncode == 0, narrow.stderr
        fits(narrow.stdout.splitlines(), 40)
        assert short_peer_id(PEERS[0]) in narrow.stdout
    gone = run_cli("status", "--api", url)
    assert gone.returncode == 2 and gone.stderr.startswith("error: cannot read ")
    assert len(gone.stderr.splitlines()) == 1


def test_models_and_keys_json_keys(tmp_path: Path) -> None:
    out = run_cli("models", "--json")
    assert out.returncode == 0, out.stderr
    models = json.loads(out.stdout)["models"]
    assert set(models[0]) >= {"name", "description", "parameters", "memory", "hf_id"}
    key = tmp_path / "key"
    assert run_cli("keys", "new", "--identity", str(key)).returncode == 0
    shown = json.loads(run_cli("keys", "show", "--identity", str(key), "--json").stdout)
    assert set(shown) == {"peer_id", "public_key", "path"}


def test_json_documents_keep_the_keys_of_docs_cli_md() -> None:
    """The documents behind ``--json`` of status --leaderboard, demo and doctor (``simulate``,
    ``status``, ``models`` and ``keys show`` are checked end to end)."""
    from p2pdiloco.core.ledger import Ledger, LedgerEntry
    from p2pdiloco.harness.demo_summary import DemoResult
    from p2pdiloco.preflight import Finding

    entry = LedgerEntry(PEERS[0], accepted=3, tokens=300, rejected=1, last_version=3)
    ledger = Ledger(versions=3, entries=[entry]).to_dict()
    assert set(ledger) == {"versions", "total_tokens", "peers", "ignored"}
    assert set(ledger["peers"][0]) == {
        "rank",
        "peer_id",
        "accepted",
        "tokens",
        "rejected",
        "uncredited",
        "reasons",
        "last_version",
        "share",
    }
    demo = DemoResult(
        versions=1,
        loss_start=5.0,
        loss_end=4.0,
        seconds=1.0,
        run_id="ab",
        committee={1: []},
        peers={},
        rejected={},
    ).to_dict()
    assert set(demo) == {
        "versions",
        "loss_start",
        "loss_end",
        "seconds",
        "run_id",
        "committee",
        "peers",
        "rejected",
        "workdir",
        "fragments",
    }
    assert set(Finding("disk", "ok", "fine").as_dict()) == {"check", "severity", "detail", "fix"}
