"""``bench/parity.py`` and what it needs of simulate: one method alone gives run_simulation's own
figures, fewer evals leave training untouched, a codec schedule carries its residual, and the
bench's grids resume from their JSON and print the ratio table."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.parity import Cells, cell_key, report
from bench.parity import main as parity_main
from p2pdiloco.harness.simulate import SimulateConfig, prepare, run_simulation, train_method
from p2pdiloco.train.data import eval_batches
from p2pdiloco.train.inner import InnerConfig
from p2pdiloco.train.models import build_model
from p2pdiloco.train.outer import OuterConfig


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("texts")
    words = "each method gets its own learning rate before the two are compared. "
    for i in range(8):
        (d / f"doc{i}.txt").write_text(f"Document number {i}. " + words * 150)
    return d


def cfg(corpus_dir: Path, **kw) -> SimulateConfig:
    return SimulateConfig(
        learners=2,
        inner_steps=3,
        rounds=4,
        data=str(corpus_dir),
        eval_batches=2,
        inner=InnerConfig(lr=3e-3, warmup_steps=2, batch_size=4, seq_len=64),
        outer=OuterConfig(lr=0.7, momentum=0.5),
        **kw,
    )


def test_each_method_alone_gives_run_simulations_figures(corpus_dir: Path) -> None:
    c = cfg(corpus_dir)
    both = run_simulation(c)
    assert both.baseline is not None
    _, corpus = prepare(c)
    evals = eval_batches(corpus, batch_size=c.inner.batch_size, max_batches=c.eval_batches)
    initial = build_model(c.model, seed=c.seed)
    for method, want in (("diloco", both.diloco), ("data-parallel", both.baseline)):
        got = train_method(c, method, corpus, evals, copy.deepcopy(initial))
        assert got.eval_losses == want.eval_losses and got.tokens == want.tokens, method
        assert got.wire_bytes == want.wire_bytes
    with pytest.raises(ValueError, match="diloco"):
        train_method(c, "gossip", corpus, evals, initial)


def test_fewer_evals_leave_the_training_untouched(corpus_dir: Path) -> None:
    every = run_simulation(cfg(corpus_dir))
    sparse = run_simulation(cfg(corpus_dir, eval_every=3))
    for a, b in ((every.diloco, sparse.diloco), (every.baseline, sparse.baseline)):
        assert a is not None and b is not None
        assert b.eval_losses == [a.eval_losses[2], a.eval_losses[3]]  # rounds 3 and 4 (last)
        assert b.eval_loss_final == a.eval_loss_final


def test_a_codec_schedule_sends_the_first_codec_first_then_the_run_codec(
    corpus_dir: Path,
) -> None:
    c = cfg(corpus_dir, baseline=False)
    runs = {
        name: run_simulation(replace(c, **kw)).diloco
        for name, kw in {
            "topk2": {"compression": "topk2"},
            "int8": {"compression": "int8"},
            "int8>topk2": {
                "compression": "topk2",
                "compression_first": "int8",
                "compression_first_rounds": 2,
            },
            "unused schedule": {"compression": "topk2", "compression_first": "int8"},
        }.items()
    }
    sched, topk, int8 = runs["int8>topk2"], runs["topk2"], runs["int8"]
    assert topk.wire_bytes < sched.wire_bytes < int8.wire_bytes
    assert sched.eval_losses[:2] == int8.eval_losses[:2]  # rounds 1-2 are the int8 run's
    assert sched.eval_losses[2:] != topk.eval_losses[2:]
    assert runs["unused schedule"].eval_losses == topk.eval_losses


def test_the_bench_resumes_from_its_json_and_prints_the_table(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "parity.json"
    args = [
        "--data",
        str(corpus_dir),
        "--learners",
        "2",
        "--inner-steps",
        "2",
        "--rounds",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
        "--lrs",
        "1e-3",
        "2e-3",
        "--outer",
        "1.0:0.5",
        "--extend",
        "1",
        "--select-batches",
        "2",
        "--report-batches",
        "2",
        "--sparse",
        "topk2:sender_mean",
        "--out",
        str(out),
    ]
    assert parity_main(args) == 0
    first = json.loads(out.read_text())["cells"]
    methods = [c["method"] for c in first.values()]
    assert methods.count("data-parallel") in (2, 3) and methods.count("diloco") >= 4
    sparse = [c for c in first.values() if c["codec"] == "topk2"]
    assert len(sparse) == 1 and sparse[0]["rule"] == "sender_mean"
    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert any(line.startswith("| 2 |") and "≤ 1.01" in line for line in table)
    assert any("| topk2 | sender_mean |" in line for line in table)
    assert parity_main(args) == 0  # every cell is in the file: nothing is trained again
    again = json.loads(out.read_text())
    assert again["cells"] == first and len(again["commands"]) == 2
    assert not [line for line in capsys.readouterr().out.splitlines() if "select" in line]
    assert parity_main(["--report", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [*table[:3], "", *table[3:]]


def test_the_sparse_table_gives_upload_bytes_without_the_dense_download() -> None:
    # simulate's wire_bytes is download + upload; the download is dense fp32 for every codec
    def cell(codec: str, rule: str, wire: int, select: float, report_loss: float) -> dict:
        return {
            "method": "diloco",
            "learners": 4,
            "inner_lr": 8e-4,
            "outer_lr": 0.7,
            "outer_momentum": 0.5,
            "codec": codec,
            "rule": rule,
            "tokens": 409600,
            "select_loss": select,
            "report_loss": report_loss,
            "wire_bytes": wire,
        }

    cells = Cells(None)
    key = cell_key("diloco", 4, 8e-4, (0.7, 0.5), "")
    cells.data["cells"][key] = cell("none", "mean", 2000, 3.0, 2.5)
    cells.data["cells"][key + "/topk2:sender_mean"] = cell("topk2", "sender_mean", 1007, 3.15, 2.55)
    cells.data["cells"][key + "/none:sender_mean"] = cell("none", "sender_mean", 2000, 3.0, 2.5)
    rows = {line.split(" | ")[1]: line for line in report(cells) if line.startswith("| 4 |")}
    assert rows["topk2"].endswith("| **1.020** (met) | 1.050 | 0.0070 |")
    assert rows["none"].endswith("| **1.000** (met) | 1.000 | 1.0000 |")
