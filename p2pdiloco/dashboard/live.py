"""The ``join`` dashboard: a pure function from a :class:`DashboardSnapshot` to a renderable.

The node fills a snapshot from its own state; the CLI feeds ``render(snap)`` to
``rich.live.Live.update`` on a TTY, prints :func:`plain_line` otherwise, and :func:`json_line`
under ``--json-logs``. Nothing here does IO except :func:`save_screenshot`.

Strings in a snapshot may come from other peers (run names, model names, event text), so they
are only ever placed in ``rich.text.Text`` objects, never parsed as markup, and control
characters are replaced first: rich strips a few of them, but not ESC, which would let a peer
write escape sequences to the terminal or forge lines in a log.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from p2pdiloco.dashboard.layout import clean
from p2pdiloco.dashboard.tables import human_bytes, human_count

BLOCKS = "▁▂▃▄▅▆▇█"
BAR_WIDTH = 24  # cells of the round progress bar
MAX_EVENTS = 5  # event lines shown; the snapshot may carry more
SIDE_BY_SIDE_WIDTH = 100  # at this console width and above, network and contribution share a row

STATE_STYLES = {
    "connecting": "cyan",
    "syncing state": "cyan",
    "training": "bold green",
    "training, delta in flight": "bold green",
    "overtime, awaiting certificate": "bold yellow",
    "submitting": "blue",
    "waiting for certificate": "blue",
    "applying": "blue",
    "paused": "bold yellow",
    "idle": "dim",
    "stopping": "magenta",
    "failed": "bold red",
}

_EXAMPLE_LOSS = (
    3.42,
    3.35,
    3.37,
    3.21,
    3.18,
    3.2,
    3.05,
    3.01,
    2.97,
    3.0,
    2.91,
    2.88,
    2.9,
    2.84,
    2.8,
    2.83,
    2.77,
    2.74,
    2.76,
    2.71,
)


@dataclass
class DashboardSnapshot:
    """Everything the dashboard shows, as plain data; built by the node, rendered here."""

    # identity / run
    peer_id: str  # this node's libp2p peer id
    run_id: str | None = None  # hex id of the joined run; None before one is chosen
    run_name: str | None = None  # human name of the run (peer-supplied)
    model: str | None = None  # registered model name (peer-supplied)
    state: str = "connecting"  # one of STATE_STYLES' keys; free text is shown unstyled
    paused_reason: str | None = None  # shown when state == "paused"
    # "stalled: no certificate for version 12 for 95 s (waiting on committee …)"; None while
    # certificates come within the run's grace + agree_timeout of sending a delta
    stalled: str | None = None
    version: int = 0  # global certified version held
    # round progress
    inner_step: int = 0  # inner steps of the current stretch (since the last delta), up to H
    inner_steps: int = 0  # steps per delta: H, or H/P with P fragments
    overtime_steps: int = 0  # steps trained past the stretch while its delta waits
    fragments: int = 1  # Streaming DiLoCo fragments P of the run (sync.fragments)
    fragment: int = 0  # the fragment this round syncs: version mod P
    eta_seconds: float | None = None  # seconds until this stretch's delta is due (a countdown)
    waiting_on: str | None = None  # what the node awaits, e.g. "certificate for version 13"
    waiting_seconds: float = 0.0  # for how long
    tokens_per_second: float = 0.0  # local training throughput
    utilization: float = 0.0  # share of wall time in inner steps (runtime.trainer)
    loss_local: list[float] = field(default_factory=list)  # recent train losses, newest last
    # Eval loss per certified version: the certificates' own (ADR 0059) in a run with a held-out
    # split, else this node's local evaluation of small models.
    loss_global: list[float] = field(default_factory=list)
    # network
    peers_direct: int = 0  # peers reached over a direct connection
    peers_relayed: int = 0  # peers reached through a relay
    islands: int = 0  # islands (groups of mutually reachable peers) in the run
    reachability: str = "unknown"  # "direct" | "relayed" | "unknown"
    committee_duty: str = "none this round"  # e.g. "syncer (leader) for version 12"
    bytes_up: int = 0  # total bytes sent since start
    bytes_down: int = 0  # total bytes received since start
    up_rate: float = 0.0  # bytes/s, recent
    down_rate: float = 0.0  # bytes/s, recent
    # your contribution
    accepted: int = 0  # deltas of ours that made it into a certified version, credited
    uncredited: int = 0  # deltas of ours merged without credit: no work shown (ADR 0065)
    rejected: int = 0  # deltas of ours screened out, as certified (status --leaderboard's)
    rejected_reasons: dict[str, int] = field(default_factory=dict)  # reason code → count
    late: int = 0  # deltas of ours that came too late to be merged (not rejected)
    late_reasons: dict[str, int] = field(default_factory=dict)  # reason code → count
    tokens_contributed: int = 0  # tokens of accepted deltas
    share: float = 0.0  # 0..1 share of the run's accepted tokens
    rank: int | None = None  # 1-based rank by accepted tokens; None before the first one
    ranked_peers: int = 0  # peers in that ranking
    events: list[str] = field(default_factory=list)  # recent event lines, newest last

    @classmethod
    def example(cls) -> DashboardSnapshot:
        """A realistic mid-round snapshot, for tests, screenshots and the docs."""
        return cls(
            peer_id="12D3KooWQx5f8hVbRZzLwM3tYc9p2NkJr7sA1eGdUoHvXy4iTqBm",
            run_id="3f9a2c1be07d4b5a" * 4,
            run_name="wikitext-demo",
            model="gemma-tiny",
            state="training",
            version=12,
            inner_step=12,
            inner_steps=20,
            eta_seconds=65.0,
            tokens_per_second=1234.5,
            loss_local=list(_EXAMPLE_LOSS),
            loss_global=[3.61, 3.24, 3.02, 2.93],
            peers_direct=3,
            peers_relayed=1,
            islands=2,
            reachability="direct",
            committee_duty="syncer (leader) for version 12",
            bytes_up=12_900_000,
            bytes_down=103_500_000,
            up_rate=46_080.0,
            down_rate=215_347.0,
            accepted=41,
            rejected=2,
            rejected_reasons={"screened_out": 2},
            late=1,
            late_reasons={"round_closed": 1},
            tokens_contributed=1_638_400,
            share=0.184,
            rank=2,
            ranked_peers=7,
            events=[
                "12:00:41 joined run wikitext-demo (3f9a2c1b)",
                "12:01:03 state synced: version 11 from 3 peers",
                "12:03:17 delta accepted into version 11",
                "12:03:20 certificate for version 12: 5 deltas, 4 signers",
                "12:03:21 applied version 12",
                "12:03:22 elected syncer (leader) for version 12",
            ],
        )

    @classmethod
    def example_paused(cls) -> DashboardSnapshot:
        """The example with the network gone, as the dashboard shows while it retries."""
        snap = cls.example()
        snap.state = "paused"
        snap.paused_reason = "network lost, retrying in 8 s"
        snap.eta_seconds = None
        snap.tokens_per_second = 0.0
        snap.peers_direct = snap.peers_relayed = 0
        snap.reachability = "unknown"
        snap.committee_duty = "none this round"
        snap.up_rate = snap.down_rate = 0.0
        snap.events = [*snap.events, "12:04:02 lost all peers; pausing training"]
        return snap

    @classmethod
    def example_stalled(cls) -> DashboardSnapshot:
        """The example waiting, past grace + agree_timeout, for a committee that cannot certify."""
        snap = cls.example()
        snap.state = "overtime, awaiting certificate"
        snap.inner_step = snap.inner_steps
        snap.overtime_steps = 7
        snap.eta_seconds = None
        snap.waiting_on, snap.waiting_seconds = "certificate for version 13", 95.0
        snap.stalled = (
            "stalled: no certificate for version 13 for 95 s (waiting on committee …a1b2c3d4, "
            "…c3d4e5f6, …e5f6a7b8; unreachable: …c3d4e5f6, …e5f6a7b8)"
        )
        return snap


# ---------------------------------------------------------------- formatting helpers


def sparkline(values: Sequence[float], width: int = 24) -> str:
    """The last ``width`` finite values as block characters, low ▁ to high █.

    Empty input (or nothing finite) gives ""; a constant series gives mid-height blocks.
    """
    finite = [v for v in values if math.isfinite(v)]
    if width <= 0 or not finite:
        return ""
    finite = finite[-width:]
    lo, hi = min(finite), max(finite)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return BLOCKS[len(BLOCKS) // 2 - 1] * len(finite)
    top = len(BLOCKS) - 1
    return "".join(BLOCKS[round((v - lo) / (hi - lo) * top)] for v in finite)


def format_duration(seconds: float) -> str:
    """``42s``, ``1m05s``, ``2h03m``; negative durations read as ``0s``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"


def next_sync_text(snap: DashboardSnapshot) -> str:
    """When this node syncs next (its stretch's delta is due: a countdown), and what it awaits
    meanwhile; in overtime, only what it waits on."""
    eta = snap.eta_seconds
    waiting = (
        f"awaiting {clean(snap.waiting_on)} ({format_duration(snap.waiting_seconds)})"
        if snap.waiting_on
        else None
    )
    if eta is not None and math.isfinite(eta):
        due = f"next sync in {format_duration(eta)}"
        return f"{due} · {waiting}" if waiting else due
    if waiting:
        return waiting
    if snap.state == "idle":
        return "no sync planned (idle)"
    return "next sync time unknown"


def reasons_text(reasons: dict[str, int]) -> str:
    """``round_closed 2, stale 1``: reason codes by count, the most frequent first."""
    ordered = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{clean(code)} {n}" for code, n in ordered)


def _last_finite(values: Iterable[float]) -> float | None:
    return next((v for v in reversed(list(values)) if math.isfinite(v)), None)


def _rate(tps: float) -> str:
    return f"{human_count(tps if math.isfinite(tps) else 0.0)} tok/s"


def _run_label(snap: DashboardSnapshot) -> str:
    name = clean(snap.run_name) if snap.run_name else "no run yet"
    return f"{name} ({clean(snap.run_id)[:8]})" if snap.run_id else name


def _state_label(snap: DashboardSnapshot) -> str:
    state = clean(snap.state)
    if snap.state == "paused" and snap.paused_reason:
        return f"{state}: {clean(snap.paused_reason)}"
    return state


def _rank_text(snap: DashboardSnapshot) -> str:
    if snap.rank is None:
        return f"not ranked yet ({snap.ranked_peers} ranked peers)"
    return f"#{snap.rank} of {snap.ranked_peers}"


# ---------------------------------------------------------------- rich rendering


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2), expand=True)
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(overflow="fold", ratio=1)
    return grid


def _progress_bar(done: int, total: int, overtime: int = 0) -> Text:
    frac = min(max(done / total, 0.0), 1.0) if total > 0 else 0.0
    filled = round(frac * BAR_WIDTH)
    bar = Text()
    bar.append("━" * filled, style="yellow" if overtime else "green")
    bar.append("─" * (BAR_WIDTH - filled), style="dim")
    bar.append(f" {done}/{total} steps")
    if overtime:
        bar.append(f" +{overtime} overtime", style="yellow")
    return bar


def _header(snap: DashboardSnapshot) -> Text:
    line = Text()
    line.append(_run_label(snap), style="bold")
    line.append("  ·  model ", style="dim")
    line.append(clean(snap.model) if snap.model else "?")
    line.append("  ·  ", style="dim")
    line.append("● " + clean(snap.state), style=STATE_STYLES.get(snap.state, ""))
    line.append("  ·  version ", style="dim")
    line.append(str(snap.version), style="bold")
    if snap.state == "paused" and snap.paused_reason:
        line.append("\n↳ " + clean(snap.paused_reason), style="yellow")
    if snap.stalled:
        line.append("\n↳ " + clean(snap.stalled), style="bold red")
    return line


def _training_panel(snap: DashboardSnapshot) -> Panel:
    grid = _grid()
    grid.add_row("Peer", Text(clean(snap.peer_id)))
    grid.add_row("Round", _progress_bar(snap.inner_step, snap.inner_steps, snap.overtime_steps))
    if snap.stalled:  # what it waits on is in the stall line above
        grid.add_row("Sync", Text("stalled", style="bold red"))
    else:
        grid.add_row("Sync", Text(next_sync_text(snap)))
    if snap.fragments > 1:
        grid.add_row("Fragments", _fragments_text(snap))
    speed = f"{_rate(snap.tokens_per_second)}  ·  {100 * snap.utilization:.0f}% of time training"
    grid.add_row("Speed", Text(speed))
    loss = Text()
    spark = sparkline(snap.loss_local)
    local, global_ = _last_finite(snap.loss_local), _last_finite(snap.loss_global)
    if spark:
        loss.append(spark, style="cyan")
        loss.append(" ")
    loss.append(f"local {local:.3f}" if local is not None else "no local loss yet")
    loss.append("  ·  ", style="dim")
    loss.append(f"global eval {global_:.3f}" if global_ is not None else "no global eval yet")
    if len(snap.loss_global) > 1:  # one value per version: certified ones where the run has them
        loss.append(" " + sparkline(snap.loss_global), style="green")
    grid.add_row("Loss", loss)
    body = Group(_header(snap), Text(), grid)
    return Panel(body, title=Text("p2pdiloco join", style="bold"), box=box.ROUNDED)


def _fragments_text(snap: DashboardSnapshot) -> Text:
    """This round's fragment, and the version that last synced each fragment."""
    text = Text()
    text.append(f"syncing {snap.fragment + 1} of {snap.fragments}", style="bold")
    text.append("  ·  last synced ", style="dim")
    lasts = []
    for f in range(snap.fragments):
        last = last_synced(snap.version, f, snap.fragments)
        lasts.append(f"{f + 1}:v{last}" if last is not None else f"{f + 1}:-")
    text.append(" ".join(lasts))
    return text


def last_synced(version: int, fragment: int, fragments: int) -> int | None:
    """The newest version up to ``version`` that updated ``fragment`` (version u syncs fragment
    (u − 1) mod P); None before its first."""
    last = version - (version - 1 - fragment) % fragments
    return last if last >= 1 else None


def _network_panel(snap: DashboardSnapshot) -> Panel:
    grid = _grid()
    grid.add_row("Peers", Text(f"{snap.peers_direct} direct, {snap.peers_relayed} relayed"))
    grid.add_row("Islands", Text(str(snap.islands)))
    grid.add_row("Reachability", Text(clean(snap.reachability)))
    grid.add_row("Committee", Text(clean(snap.committee_duty)))
    bandwidth = Text()
    bandwidth.append(f"↑ {human_bytes(snap.bytes_up)} ({human_bytes(snap.up_rate)}/s)\n")
    bandwidth.append(f"↓ {human_bytes(snap.bytes_down)} ({human_bytes(snap.down_rate)}/s)")
    grid.add_row("Bandwidth", bandwidth)
    return Panel(grid, title="Network", title_align="left", box=box.ROUNDED)


def _contribution_panel(snap: DashboardSnapshot, pad: int = 0) -> Panel:
    """``pad`` blank rows at the bottom line it up with the network panel beside it."""
    grid = _grid()
    deltas = Text()
    deltas.append(f"{snap.accepted} accepted", style="green")
    deltas.append(", ")
    deltas.append(f"{snap.rejected} rejected", style="red" if snap.rejected else "")
    if snap.uncredited:  # merged, but the committee saw no work on our rows in them
        deltas.append(f", {snap.uncredited} merged without credit", style="yellow")
    grid.add_row("Deltas", deltas)  # as certified: the counts of ``status --leaderboard``
    grid.add_row("Rejected", Text(reasons_text(snap.rejected_reasons) or "none"))
    late = f"{snap.late} ({reasons_text(snap.late_reasons)})" if snap.late else "0"
    grid.add_row("Late", Text(late, style="yellow" if snap.late else ""))
    grid.add_row("Tokens", Text(f"{human_count(snap.tokens_contributed)} tokens accepted"))
    grid.add_row("Share", Text(f"{100 * snap.share:.1f}% of the run"))
    grid.add_row("Rank", Text(_rank_text(snap)))
    for _ in range(pad):
        grid.add_row("", "")
    return Panel(grid, title="Your contribution", title_align="left", box=box.ROUNDED)


def _counted(n: int, what: str, reasons: dict[str, int]) -> str:
    """``2 late (round_closed 2)``; the reasons only when there are some."""
    return f"{n} {what} ({reasons_text(reasons)})" if n and reasons else f"{n} {what}"


def _events_panel(snap: DashboardSnapshot) -> Panel:
    shown = snap.events[-MAX_EVENTS:]
    lines = [Text(clean(e), overflow="fold") for e in shown] or [Text("no events yet", "dim")]
    return Panel(Group(*lines), title="Last events", title_align="left", box=box.ROUNDED)


class _Dashboard:
    """Lays the panels out for the width it is given: side by side from 100 columns."""

    def __init__(self, snap: DashboardSnapshot) -> None:
        self.snap = snap

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        snap = self.snap
        middle: RenderableType
        if options.max_width >= SIDE_BY_SIDE_WIDTH:
            row = Table.grid(padding=(0, 1), expand=True)
            row.add_column(ratio=3)
            row.add_column(ratio=2)
            # network has five rows, bandwidth taking two lines; contribution has six
            row.add_row(_network_panel(snap), _contribution_panel(snap))
            middle = row
        else:
            middle = Group(_network_panel(snap), _contribution_panel(snap))
        yield Group(_training_panel(snap), middle, _events_panel(snap))


def render(snap: DashboardSnapshot) -> RenderableType:
    """The whole dashboard; pure, so ``Live.update(render(snap))`` on every new snapshot."""
    return _Dashboard(snap)


# ---------------------------------------------------------------- non-TTY output


def plain_line(snap: DashboardSnapshot) -> str:
    """One log line for a non-terminal or ``--no-tui``: state, progress, speed, loss, peers."""
    local = _last_finite(snap.loss_local)
    parts = [
        f"[{_state_label(snap)}]",
        f"version {snap.version}",
        f"step {snap.inner_step}/{snap.inner_steps}"
        + (f" +{snap.overtime_steps} overtime" if snap.overtime_steps else ""),
        *([f"fragment {snap.fragment + 1}/{snap.fragments}"] if snap.fragments > 1 else []),
        _rate(snap.tokens_per_second),
        f"compute {100 * snap.utilization:.0f}%",
        f"loss {local:.3f}" if local is not None else "loss -",
        f"peers {snap.peers_direct} direct {snap.peers_relayed} relayed",
        next_sync_text(snap),
        f"deltas {snap.accepted} accepted"
        + (f" {snap.uncredited} uncredited" if snap.uncredited else "")
        + f" {_counted(snap.rejected, 'rejected', snap.rejected_reasons)}"
        f" {_counted(snap.late, 'late', snap.late_reasons)}",
    ]
    if snap.stalled:
        parts.append(clean(snap.stalled))
    return " | ".join(parts)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def json_line(snap: DashboardSnapshot) -> str:
    """The snapshot as one JSON object; NaN and infinities become null to stay valid JSON."""
    data = {k: _finite_or_none(v) for k, v in dataclasses.asdict(snap).items()}
    return json.dumps(data, allow_nan=False)


def save_screenshot(path: Path, snap: DashboardSnapshot | None = None, width: int = 100) -> None:
    """Write the dashboard for ``snap`` (default: the example) as an SVG ``width`` columns wide."""
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render(snap if snap is not None else DashboardSnapshot.example()))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    console.save_svg(str(path), title="p2pdiloco join")
