"""The CLI as a user runs it: real subprocesses, exit codes, one-line errors, JSON on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.netutil import run_cli as forked_cli


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "100", "HF_HUB_OFFLINE": "1"}
    return forked_cli(*args, env=env, timeout=timeout)


@pytest.mark.parametrize("cmd", [[], ["models"], ["simulate"]])
def test_help(cmd: list[str]) -> None:
    out = run_cli(*cmd, "--help")
    assert out.returncode == 0, out.stderr
    assert "Usage" in out.stdout


def test_simulate_help_lists_required_flags() -> None:
    out = run_cli("simulate", "--help").stdout
    for flag in (
        "--learners",
        "--inner-steps",
        "--rounds",
        "--model",
        "--data",
        "--seed",
        "--json",
    ):
        assert flag in out


def test_models_json_lists_every_model_with_count_and_memory() -> None:
    out = run_cli("models", "--json")
    assert out.returncode == 0, out.stderr
    models = {m["name"]: m for m in json.loads(out.stdout)["models"]}
    assert set(models) == {
        "gemma-tiny",
        "gemma-small",
        "gemma-270m",
        "gemma-1b",
        "gemma-4b",
        "gemma-12b",
        "gemma-27b",
    }
    assert models["gemma-12b"]["parameters"] == 11_766_034_176
    for m in models.values():
        assert set(m["memory"]) == {"fp32", "bf16-mixed", "bf16"}
        assert all(v["total"] > 0 for v in m["memory"].values())


def test_models_table() -> None:
    out = run_cli("models")
    assert out.returncode == 0
    assert "gemma-12b" in out.stdout and "11.77B" in out.stdout


@pytest.fixture()
def text_dir(tmp_path: Path) -> Path:
    d = tmp_path / "texts"
    d.mkdir()
    sentence = "The quick brown fox jumps over the lazy dog while the cat sleeps. "
    for i in range(6):
        (d / f"doc{i}.txt").write_text(f"Document {i}. " + sentence * 120)
    return d


def test_simulate_json_on_a_text_directory(text_dir: Path) -> None:
    out = run_cli(
        "simulate",
        "--learners",
        "2",
        "--inner-steps",
        "6",
        "--rounds",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
        "--inner-lr",
        "3e-3",
        "--eval-batches",
        "2",
        "--data",
        str(text_dir),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for method in ("diloco", "baseline"):
        m = result[method]
        assert m["eval_loss_final"] < m["eval_loss_initial"]
        assert m["tokens"] == 2 * 6 * 2 * 4 * 64
    assert result["bytes_ratio"] == pytest.approx(6.0)
    assert result["corpus"]["documents"] == 6
    assert set(result) >= {  # the keys docs/cli.md promises
        "model",
        "parameters",
        "device",
        "learners",
        "inner_steps",
        "rounds",
        "fragments",
        "corpus",
        "diloco",
        "baseline",
        "peak_memory_bytes",
        "aggregation",
        "adversaries",
        "attack",
        "accepted_deltas",
        "rejected_deltas",
        "loss_ratio",
        "bytes_ratio",
    }
    assert "tokens_per_second" in result["diloco"] and "eval_losses" in result["baseline"]
    # stdout is the JSON alone; progress goes to stderr, a line per step chunk and per eval.
    progress = out.stderr.splitlines()
    for needle in (
        "DiLoCo round 1/2 learner 1: train loss ",
        "DiLoCo round 2/2: eval loss ",
        "data-parallel round 2/2: eval loss ",
    ):
        assert any(line.startswith(needle) for line in progress), out.stderr
    assert progress[-1].endswith(f"[{2 * 6 * 2 * 2}/{2 * 6 * 2 * 2} steps]"), out.stderr


@pytest.mark.parametrize("case", ["missing", "empty", "unreadable"])
def test_bad_data_dir_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    target = tmp_path / "data"
    if case != "missing":
        target.mkdir()
    if case == "unreadable":
        (target / "ok.txt").write_text("some text " * 100)
        (target / "bad.txt").symlink_to(tmp_path / "does-not-exist")
    out = run_cli("simulate", "--data", str(target), "--rounds", "1", "--inner-steps", "1")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert str(target) in lines[0]


def test_unknown_model_and_bad_fragments_are_user_errors() -> None:
    out = run_cli("simulate", "--model", "nope")
    assert out.returncode == 2 and "unknown model 'nope'" in out.stderr
    out = run_cli("simulate", "--inner-steps", "5", "--fragments", "2")
    assert out.returncode == 2 and "multiple of --fragments" in out.stderr


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--fragments", "3"], "must be a multiple of the fragments"),
        (["--fragments", "100", "--inner-steps", "500"], "more than the 54 tensors of gemma-tiny"),
        (["--aggregation", "nope"], "aggregation rule 'nope'"),
        (["--aggregation", "trimmed_mean", "--agg-param", "g=1"], "takes ['f']"),
        (["--compression", "int2"], "codec 'int2'"),
        (["--update-compression", "topk2"], "updates with codec 'topk2'"),
        (["--weight-cap", "2"], "invalid sync rule weight_cap"),
        (["--grace", "0"], "invalid sync rule grace"),
        (["--time-budget", "0"], "invalid run setting time_budget"),
        (["--grace", "10", "--grace-min", "11"], "invalid sync rules: grace_min must not exceed"),
        (["--time-budget", "60", "--grace", "60"], "--time-budget 60 s must be below --grace"),
    ],
)
def test_run_create_refuses_rules_before_signing_or_network(
    tmp_path: Path, flags: list[str], needle: str
) -> None:
    out = run_cli(
        "run",
        "create",
        "--name",
        "x",
        "--model",
        "gemma-tiny",
        "--identity",
        str(tmp_path / "key"),
        "--bootstrap",
        "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWAsa7ZiGkhWgeGvQnAU2A1sdCFVMWXxihKGxzhJE1nYbe",
        *flags,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], out.stderr


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: (d / "blob").write_bytes(b"\x7fELF\x00\x01" * 4096) and d / "blob",
         "is not text"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "no "),
        (lambda d: "hf:", "expected hf:NAME"),
    ],
)  # fmt: skip
def test_run_create_checks_its_data_before_signing(tmp_path: Path, make: Any, needle: str) -> None:
    # A run whose --data no volunteer can train on is refused in one line, before anything is
    # signed or published (issue 39).
    data = make(tmp_path)
    t0 = time.monotonic()
    out = run_cli(
        "run", "create", "--name", "x", "--model", "gemma-tiny", "--data", str(data),
        "--identity", str(tmp_path / "key"),
        "--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWAsa7ZiGkhWgeGvQnAU2A1sdCFVMWXxihKGxzhJE1nYbe",
    )  # fmt: skip
    took = time.monotonic() - t0
    assert out.returncode == 2 and "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], out.stderr
    assert not (tmp_path / "key").exists()  # refused before the identity was made
    print(f"refused in {took:.2f} s: {errors[0]}")


def test_run_create_and_simulate_help_list_the_sync_rules() -> None:
    for cmd in (["run", "create"], ["simulate"]):
        out = run_cli(*cmd, "--help").stdout
        for flag in ("--aggregation", "--agg-param", "--screen-norm-factor", "--weight-cap"):
            assert flag in out, (cmd, flag)
    out = run_cli("run", "create", "--help").stdout
    for flag in ("--staleness", "--grace", "--linger", "--agree-timeout", "--compression"):
        assert flag in out, flag


def test_run_create_defaults_to_safe_rules_and_prints_what_it_signed(tmp_path: Path) -> None:
    key = ["--identity", str(tmp_path / "key")]
    out = run_cli(
        "run", "create", "--name", "x", "--model", "gemma-tiny", *key, "--dry-run", "--json"
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    manifest = doc["manifest"]
    assert doc["published"] is False and len(doc["run_id"]) == 64
    assert manifest["compression"] == "int8"
    assert manifest["rules"]["update_codec"] == "int8"
    assert manifest["rules"]["aggregation"] == "median"  # ADR 0039
    assert manifest["rules"]["aggregation_params"] == {}
    assert manifest["rules"]["clone_factor"] == 0.25  # ADR 0036
    assert manifest["rules"]["screen_norm_factor"] == 3.0
    assert manifest["time_budget"] is None  # H steps per delta unless the creator sets a budget
    text = run_cli("run", "create", "--name", "x", "--model", "gemma-tiny", *key, "--dry-run")
    assert text.returncode == 0, text.stderr
    # The whole signed manifest is printed, not only its id.
    for key_name in (
        '"compression": "int8"',
        '"aggregation": "median"',
        '"creator"',
        "not published",
    ):
        assert key_name in text.stdout, key_name


def test_run_create_refuses_a_sparse_codec_with_a_coordinate_wise_rule(tmp_path: Path) -> None:
    key = ["--identity", str(tmp_path / "key")]
    base = ["run", "create", "--name", "x", "--model", "gemma-tiny", *key, "--dry-run", "--json"]
    out = run_cli(*base, "--compression", "topk2")  # the default rule is the median
    assert out.returncode == 2
    assert "coordinate-wise rule" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    ok = run_cli(*base, "--compression", "topk2", "--aggregation", "multi_krum")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["manifest"]["compression"] == "topk2"
