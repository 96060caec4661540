"""``p2pdiloco demo``: a bootstrap and N training nodes on loopback, then a verified summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from p2pdiloco.choices import ATTACKS, CODECS, UPDATE_CODECS, check_sparse_rule
from p2pdiloco.cli.common import user_errors
from p2pdiloco.dashboard.tables import demo_summary
from p2pdiloco.harness.demo import run_demo
from p2pdiloco.harness.demo_config import DemoConfig

_d = DemoConfig()


@user_errors
def demo(
    nodes: Annotated[int, typer.Option(help="Training nodes (separate processes).")] = _d.nodes,
    rounds: Annotated[
        int, typer.Option(help="Outer rounds; each certifies one version per fragment.")
    ] = _d.rounds,
    fragments: Annotated[
        int, typer.Option(help="Streaming DiLoCo fragments: a round per fragment, in turn.")
    ] = _d.fragments,
    model: Annotated[str, typer.Option(help="Model (see `p2pdiloco models`).")] = _d.model,
    inner_steps: Annotated[int, typer.Option(help="Inner steps per round (H).")] = _d.inner_steps,
    adversary: Annotated[
        str | None,
        typer.Option(help="The last node attacks: " + ", ".join(ATTACKS) + "."),
    ] = None,
    aggregation: Annotated[str, typer.Option(help="Robust rule of the run.")] = _d.aggregation,
    compression: Annotated[
        str, typer.Option(help=f"Delta codec: {', '.join(CODECS)}.")
    ] = _d.compression,
    update_compression: Annotated[
        str, typer.Option(help=f"Codec of the certified update: {', '.join(UPDATE_CODECS)}.")
    ] = _d.update_compression,
    committee_size: Annotated[int, typer.Option(help="Syncers per round (k).")] = _d.committee_size,
    workdir: Annotated[Path | None, typer.Option(help="Keep logs, keys and states here.")] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = _d.timeout,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run a whole network on this machine: real processes, signatures and certificates."""
    check_sparse_rule(compression, aggregation)
    cfg = DemoConfig(
        nodes=nodes,
        rounds=rounds,
        fragments=fragments,
        model=model,
        inner_steps=inner_steps,
        adversary=adversary,
        aggregation=aggregation,
        compression=compression,
        update_compression=update_compression,
        committee_size=committee_size,
        workdir=workdir,
        timeout=timeout,
    )
    err = Console(stderr=True)
    result = run_demo(cfg, progress=lambda line: err.print(f"[dim]demo:[/dim] {line}"))
    if json_out:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out = Console()
        out.print(demo_summary(result.to_dict(), out.width))
