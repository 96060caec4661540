"""``p2pdiloco netsim``: a discrete-event simulation of a whole network (``p2pdiloco.sim``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from p2pdiloco.cli.common import user_errors
from p2pdiloco.errors import ConfigError


@user_errors
def netsim(
    peers: Annotated[int, typer.Option(min=1, max=100_000, help="Peers at the start.")] = 64,
    minutes: Annotated[float, typer.Option(min=1, help="Simulated minutes.")] = 60.0,
    committee: Annotated[int, typer.Option(min=1, max=64, help="Committee size k.")] = 8,
    inner_steps: Annotated[int, typer.Option(min=1, help="H: inner steps per delta.")] = 100,
    step_seconds: Annotated[float, typer.Option(help="Median seconds per inner step.")] = 1.0,
    mtbf_hours: Annotated[
        float | None, typer.Option(help="Mean hours between failures per peer (none: no faults).")
    ] = None,
    repair_minutes: Annotated[float, typer.Option(help="Mean down time after a failure.")] = 10.0,
    churn: Annotated[float, typer.Option(help="Share of peers replaced per hour.")] = 0.0,
    faulty: Annotated[
        float, typer.Option(help="Share of peers that sign a wrong state on a committee.")
    ] = 0.0,
    payload_mb: Annotated[
        float, typer.Option(help="MB of one compressed delta of the whole model.")
    ] = 4.0,
    fragments: Annotated[
        int, typer.Option(min=1, help="Streaming DiLoCo fragments: a delta is 1/P of the model.")
    ] = 1,
    seed: Annotated[int, typer.Option(help="Seed of every draw.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Simulate a network of peers on the real round code.

    Peers train on simulated time, committees are elected and run the real syncer round, and
    certificates need a quorum; data-parallel runs beside it on the same faults. Prints goodput
    (tokens in certified versions ÷ what the hardware could train), certificate latency, bytes
    and committee failures. No tensors: see docs/adr/0021-network-simulator.md.
    """
    from p2pdiloco.sim import SimConfig, simulate_run

    try:
        cfg = SimConfig(
            peers=peers,
            duration=minutes * 60,
            committee_size=committee,
            inner_steps=inner_steps,
            step_seconds=step_seconds,
            mtbf_hours=mtbf_hours,
            repair_seconds=repair_minutes * 60,
            churn_per_hour=churn,
            faulty_syncers=faulty,
            payload_bytes=int(payload_mb * 1e6),
            update_bytes=int(payload_mb * 1e6),
            seed=seed,
            fragments=fragments,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    result, _ = simulate_run(cfg)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    table = Table(title=f"{peers} peers, {minutes:g} simulated minutes")
    table.add_column("figure")
    table.add_column("value", justify="right")
    dp = result.data_parallel
    rows = [
        ("versions certified", f"{result.versions}"),
        ("goodput (DiLoCo)", f"{result.goodput:.1%}"),
        ("goodput (data-parallel, same faults)", f"{dp.goodput:.1%}" if dp else "-"),
        (
            "certificate latency p50 / p95 / p99",
            f"{result.latency_p50:.0f} / {result.latency_p95:.0f} / {result.latency_p99:.0f} s",
        ),
        ("view changes / failed merges", f"{result.view_changes} / {result.failed_merges}"),
        ("wrong or conflicting certificates", f"{result.wrong_certificates + result.conflicts}"),
        ("MB per learner per delta", f"{result.learner_bytes_per_delta / 1e6:.1f}"),
        ("MB per syncer per round", f"{result.syncer_bytes_per_round / 1e6:.1f}"),
        ("MB relayed per syncer per round", f"{result.relayed_bytes_per_round / 1e6:.1f}"),
        ("simulated events / wall seconds", f"{result.events} / {result.wall_seconds:.1f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
