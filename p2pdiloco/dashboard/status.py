"""``status`` rendering: a pure function from the network-state dict to a renderable."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text


def status_view(state: dict[str, Any]) -> RenderableType:
    runs = Table(title="Runs", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("run", "name", "model", "peers", "version", "tokens/s", "note"):
        runs.add_column(col, no_wrap=col in ("run", "model"))
    for r in state["runs"]:
        runs.add_row(
            r["run_id"][:12],
            str(r["name"]),
            str(r["model"]),
            str(r["peers"]),
            str(r["latest_version"]),
            f"{r['throughput_tps']:.0f}",
            r["incompatible"] or "",
        )
    peers = Table(title="Peers", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("peer", "run", "island", "reach", "version", "tokens/s", "seen"):
        peers.add_column(col, no_wrap=True)
    for p in state["peers"]:
        peers.add_row(
            p["peer_id"][-12:],
            p["run_id"][:12],
            p["island"],
            p["reachability"],
            str(p["version"]),
            f"{p['throughput_tps']:.0f}",
            f"{p['last_seen_s']:.0f}s ago",
        )
    parts: list[RenderableType] = [runs, peers]
    parts.append(Text(f"{len(state['bootstraps'])} bootstrap server(s) alive", style="dim"))
    if state.get("rejected_records"):
        parts.append(
            Text(f"{len(state['rejected_records'])} invalid record(s) ignored", style="yellow")
        )
    return Group(*parts)


def leaderboard_view(board: dict[str, Any]) -> RenderableType:
    """Peers ranked by verified accepted tokens, and what was ignored (with why)."""
    table = Table(
        title=f"Contributions to run {board['run_name']} ({board['run_id'][:12]}): "
        f"{board['versions']} verified versions",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for col in ("rank", "peer", "accepted", "rejected", "tokens", "share", "last version"):
        table.add_column(col, justify="left" if col == "peer" else "right", no_wrap=True)
    for p in board["peers"]:
        table.add_row(
            str(p["rank"]),
            Text("…" + p["peer_id"][-16:]),
            str(p["accepted"]),
            str(p["rejected"]),
            f"{p['tokens']:,}",
            f"{100 * p['share']:.1f}%",
            str(p["last_version"]),
        )
    parts: list[RenderableType] = [table]
    for line in board["ignored"]:
        parts.append(Text(f"ignored: {line}", style="yellow"))
    return Group(*parts)
