"""``p2pdiloco doctor``: check this machine and its settings before joining a run."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from p2pdiloco.cli.common import user_errors
from p2pdiloco.config import resolve_bootstrap
from p2pdiloco.dashboard.tables import findings_view
from p2pdiloco.errors import ConfigError
from p2pdiloco.preflight import Finding, PreflightConfig, run_preflight, worst


def parse_gpus(value: str | None) -> tuple[int, ...]:
    """``"0,2"`` → (0, 2); ConfigError with a one-line message for anything else."""
    if value is None:
        return ()
    items = [v.strip() for v in value.split(",")]
    if not items or not all(v.isdigit() for v in items):
        raise ConfigError(f"--gpus takes comma-separated GPU indices like 0,2, not '{value}'")
    gpus = tuple(int(v) for v in items)
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"--gpus lists a GPU twice: '{value}'")
    return gpus


def summary_line(findings: list[Finding]) -> str:
    counts = Counter(f.severity for f in findings)
    words = {"error": "error", "warn": "warning", "info": "note"}
    parts = [
        f"{counts[s]} ok" if s == "ok" else f"{counts[s]} {words[s]}{'' if counts[s] == 1 else 's'}"
        for s in ("error", "warn", "info", "ok")
        if counts[s]
    ]
    verdict = {
        "error": "fix the errors above before joining",
        "warn": "can join; the warnings above cost speed or reliability",
    }.get(worst(findings), "ready to join")
    return f"doctor: {', '.join(parts)}: {verdict}"


@user_errors
def doctor(
    model: Annotated[str | None, typer.Option(help="Model to check memory and disk for.")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda[:N], mps or xla.")] = "auto",
    gpus: Annotated[str | None, typer.Option(help="Use only these CUDA GPUs, e.g. 0,2.")] = None,
    max_memory: Annotated[
        float | None, typer.Option(help="GiB the node may use [default: what is free].")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="Micro-batch sequences [default: largest that fits].")
    ] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="Where checkpoints go [default: XDG data path].")
    ] = None,
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Bootstrap multiaddr (repeatable).")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per bootstrap connect.")] = 3.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """Check Python, torch, GPU, memory, disk and bootstrap servers; exit 1 on any error."""
    if max_memory is not None and max_memory <= 0:
        raise ConfigError(f"--max-memory must be a positive number of GiB, not {max_memory}")
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, not {batch_size}")
    if timeout <= 0:
        raise ConfigError(f"--timeout must be positive, not {timeout}")
    gpu_indices = parse_gpus(gpus)
    addrs, source = resolve_bootstrap(bootstrap)
    cfg = PreflightConfig(
        model=model,
        device=device,
        gpus=gpu_indices,
        max_memory_gb=max_memory,
        batch_size=batch_size,
        state_dir=state_dir,
        bootstrap=tuple(addrs),
        timeout=timeout,
    )
    findings = run_preflight(cfg)
    if json_out:
        print(json.dumps([f.as_dict() for f in findings], indent=2))
        print(summary_line(findings), file=sys.stderr)
    else:
        console = Console()
        if addrs:
            console.print(Text(f"bootstrap servers from {source}", style="dim"))
        console.print(findings_view([f.as_dict() for f in findings], console.width))
        console.print(summary_line(findings), highlight=False)
    if worst(findings) == "error":
        raise typer.Exit(1)
