"""``status`` rendering: a pure function from the network-state dict to a renderable."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from p2pdiloco.dashboard.layout import Cell, Column, fitted_table, short_peer_id


def status_view(state: dict[str, Any], width: int = 80) -> RenderableType:
    """Runs, then peers (short ids), then the bootstrap count. Narrow widths drop the runs'
    notes, throughput and model, and the peers' island, run, last-seen and reachability."""
    run_columns = [
        Column("run"),
        Column("name", shrink=True),
        Column("model", drop=1),
        Column("peers", "right"),
        Column("version", "right"),
        Column("tokens/s", "right", drop=2),
        Column("note", shrink=True, drop=3),
    ]
    run_cells: list[list[Cell]] = [
        [
            r["run_id"][:12],
            str(r["name"]),
            str(r["model"]),
            str(r["peers"]),
            str(r["latest_version"]),
            f"{r['throughput_tps']:.0f}",
            r["incompatible"] or "",
        ]
        for r in state["runs"]
    ]
    stalls = [
        Text(f"run {r['run_id'][:12]} stalled: {r['stalled']}", style="bold yellow")
        for r in state["runs"]
        if r.get("stalled")
    ]
    peer_columns = [
        Column("peer"),
        Column("run", drop=4),
        Column("island", shrink=True, drop=5),
        Column("reach", drop=2),
        Column("version", "right"),
        Column("tokens/s", "right", drop=1),
        Column("seen", "right", drop=3),
    ]
    peer_cells: list[list[Cell]] = [
        [
            short_peer_id(p["peer_id"]),
            p["run_id"][:12],
            str(p["island"]),
            str(p["reachability"]),
            str(p["version"]),
            f"{p['throughput_tps']:.0f}",
            f"{p['last_seen_s']:.0f}s ago",
        ]
        for p in state["peers"]
    ]
    parts: list[RenderableType] = [
        Text("Runs", style="bold"),
        fitted_table(run_columns, run_cells, width),
        *stalls,
        Text(),
        Text("Peers", style="bold"),
        fitted_table(peer_columns, peer_cells, width),
    ]
    parts.append(Text(f"{len(state['bootstraps'])} bootstrap server(s) alive", style="dim"))
    if state.get("rejected_records"):
        parts.append(
            Text(f"{len(state['rejected_records'])} invalid record(s) ignored", style="yellow")
        )
    return Group(*parts)


def leaderboard_view(board: dict[str, Any], width: int = 80) -> RenderableType:
    """Peers ranked by verified accepted tokens, and what was ignored (with why). Narrow widths
    drop the uncredited count, the last version, then the rejected and accepted counts. A
    delta merged without credit (ADR 0065) counts as uncredited, neither accepted nor rejected."""
    title = Text(
        f"Contributions to run {board['run_name']} ({board['run_id'][:12]}): "
        f"{board['versions']} verified versions",
        style="bold",
    )
    columns = [
        Column("rank", "right"),
        Column("peer"),
        Column("accepted", "right", drop=1),
        Column("rejected", "right", drop=2),
        Column("uncredited", "right", drop=4),
        Column("tokens", "right"),
        Column("share", "right"),
        Column("last version", "right", drop=3),
    ]
    cells: list[list[Cell]] = [
        [
            str(p["rank"]),
            short_peer_id(p["peer_id"]),
            str(p["accepted"]),
            str(p["rejected"]),
            str(p.get("uncredited", 0)),
            f"{p['tokens']:,}",
            f"{100 * p['share']:.1f}%",
            str(p["last_version"]),
        ]
        for p in board["peers"]
    ]
    parts: list[RenderableType] = [title, fitted_table(columns, cells, width)]
    for line in board["ignored"]:
        parts.append(Text(f"ignored: {line}", style="yellow"))
    return Group(*parts)


CURVE_ROWS = 24  # versions listed at most; the sparkline shows the whole curve


def curve_view(curve: dict[str, Any], width: int = 80) -> RenderableType:
    """A run's certified eval loss (``status --curve``): a sparkline of every point, a table
    of evenly spread versions with their tokens and loss (first and last always), and whether
    the run went past its planned rounds."""
    from p2pdiloco.dashboard.live import sparkline

    points = curve["points"]
    title = Text(
        f"Certified eval loss of run {curve['run_name']} ({curve['run_id'][:12]}): "
        f"{curve['versions']} verified versions, {curve['tokens']:,} tokens",
        style="bold",
    )
    parts: list[RenderableType] = [title]
    if not points:
        why = (
            "no certificate carries an eval loss yet"
            if curve["evaluated"]
            else "this run names no held-out split: its certificates carry no eval loss"
        )
        parts.append(Text(why, style="yellow"))
    else:
        losses = [p["eval_loss"] for p in points]
        spark = sparkline(losses, width=max(8, min(len(losses), width - 30)))
        parts.append(Text(f"{spark}  {losses[0]:.4f} → {losses[-1]:.4f}", style="cyan"))
        step = max(1, -(-len(points) // CURVE_ROWS))
        shown = points[::step]
        if shown[-1] is not points[-1]:
            shown.append(points[-1])
        columns = [
            Column("version", "right"),
            Column("tokens", "right"),
            Column("eval loss", "right"),
        ]
        cells: list[list[Cell]] = [
            [str(p["version"]), f"{p['tokens']:,}", f"{p['eval_loss']:.4f}"] for p in shown
        ]
        parts.append(fitted_table(columns, cells, width))
    planned = curve.get("planned_rounds")
    if curve.get("past_plan"):
        parts.append(
            Text(
                f"past its planned {planned} rounds: the inner lr stays at its floor "
                "(ADR 0053); a longer run is a new manifest",
                style="yellow",
            )
        )
    elif planned is not None:
        parts.append(Text(f"planned: {planned} rounds", style="dim"))
    for line in curve.get("ignored", []):
        parts.append(Text(f"ignored: {line}", style="yellow"))
    return Group(*parts)
