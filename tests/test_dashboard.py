"""Rendering at a pinned terminal width: every field visible, nothing cut."""

from __future__ import annotations

from rich.console import Console

from p2pdiloco.dashboard.status import status_view
from p2pdiloco.dashboard.tables import models_table, simulation_summary
from p2pdiloco.train.memory import PRECISIONS

RESULT = {
    "model": "gemma-tiny",
    "parameters": 1019264,
    "device": "cpu",
    "learners": 4,
    "inner_steps": 20,
    "rounds": 10,
    "fragments": 1,
    "diloco": {
        "eval_loss_initial": 5.6056,
        "eval_loss_final": 2.8395,
        "tokens": 819200,
        "wire_bytes": 326_000_000,
        "syncs": 10,
        "tokens_per_second": 11893,
    },
    "baseline": {
        "eval_loss_initial": 5.6056,
        "eval_loss_final": 2.7479,
        "tokens": 819200,
        "wire_bytes": 6_500_000_000,
        "syncs": 200,
        "tokens_per_second": 11931,
    },
    "loss_ratio": 1.0333,
    "bytes_ratio": 20.0,
    "corpus": {
        "source": "embedded",
        "documents": 652,
        "train_sequences": 80541,
        "eval_sequences": 2424,
        "tokenizer": "byte",
        "fingerprint": "bfd897dedbe1",
    },
}


def render(renderable, width: int = 80) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_simulation_summary_fits_80_columns() -> None:
    text = render(simulation_summary(RESULT))
    for needle in (
        "DiLoCo",
        "data-parallel",
        "5.6056",
        "2.8395",
        "2.7479",
        "819.20k",
        "310.9 MiB",
        "6.1 GiB",
        "1.0333",
        "20.0×",
        "652 documents",
    ):
        assert needle in text, needle
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())


def test_models_table_fits_80_columns() -> None:
    rows = [
        {
            "name": "gemma-12b",
            "parameters": 11_766_034_176,
            "num_layers": 48,
            "hidden_size": 3840,
            "train_micro_batch": 1,
            "train_seq_len": 4096,
            "memory": {p: {"total": 382 * 2**30} for p in PRECISIONS},
        }
    ]
    text = render(models_table(rows, list(PRECISIONS)))
    assert "gemma-12b" in text and "11.77B" in text and "382.0" in text and "…" not in text
    assert "memory per learner, GiB" in text


def test_status_view_lists_runs_and_peers() -> None:
    state = {
        "runs": [
            {
                "run_id": "ab" * 32,
                "name": "demo",
                "model": "gemma-tiny",
                "peers": 2,
                "latest_version": 3,
                "throughput_tps": 1234.0,
                "incompatible": None,
            }
        ],
        "peers": [
            {
                "peer_id": "12D3KooW" + "x" * 44,
                "run_id": "ab" * 32,
                "island": "lab",
                "reachability": "relayed",
                "version": 3,
                "throughput_tps": 617.0,
                "last_seen_s": 2.0,
            }
        ],
        "bootstraps": [{}],
        "rejected_records": ["bad"],
    }
    text = render(status_view(state), width=100)
    for needle in (
        "abababababab",
        "demo",
        "gemma-tiny",
        "relayed",
        "lab",
        "1234",
        "2s ago",
        "1 bootstrap server",
        "1 invalid record",
    ):
        assert needle in text, needle
