"""Tables for ``models``, ``simulate`` and ``demo``: pure functions from results and a width to
rich renderables."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from p2pdiloco.dashboard.layout import Cell, Column, fitted_table, short_peer_id

GiB = 2**30


def human_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError("unreachable")


def models_table(rows: list[dict[str, Any]], precisions: list[str], width: int = 80) -> Group:
    """One row per model: size, shape, and training memory (GiB) per precision. Narrow widths
    drop the shape, the micro-batch and then the third precision."""
    columns = [
        Column("model", style="bold"),
        Column("params", "right"),
        Column("shape", "right", drop=4),
        Column("batch", "right", drop=3),
        *(Column(p, "right", drop=0 if k < 2 else 1) for k, p in enumerate(precisions)),
    ]
    cells: list[list[Cell]] = [
        [
            r["name"],
            human_count(r["parameters"]),
            f"{r['num_layers']}×{r['hidden_size']}",
            f"{r['train_micro_batch']}×{r['train_seq_len']}",
            *(f"{r['memory'][p]['total'] / GiB:.1f}" for p in precisions),
        ]
        for r in rows
    ]
    title = Text("Registered models: training memory per learner, GiB", style="bold")
    return Group(title, fitted_table(columns, cells, width))


def simulation_summary(result: dict[str, Any], width: int = 80) -> Group:
    """Final table of a simulate run: both methods at equal tokens, plus the ratios."""
    title = Text(
        f"{result['model']} ({human_count(result['parameters'])} params) on "
        f"{result['device']}: {result['learners']} learners, H={result['inner_steps']}, "
        f"{result['rounds']} rounds, {result['fragments']} fragment(s)",
        style="bold",
    )
    columns = [
        Column("method"),
        Column("loss start", "right"),
        Column("loss end", "right"),
        Column("tokens", "right", drop=1),
        Column("wire bytes", "right", drop=4),
        Column("syncs", "right", drop=3),
        Column("tok/s", "right", drop=2),
    ]
    cells: list[list[Cell]] = []
    for key in ("diloco", "baseline"):
        m = result.get(key)
        if m is None:
            continue
        cells.append(
            [
                "DiLoCo" if key == "diloco" else "data-parallel",
                f"{m['eval_loss_initial']:.4f}",
                f"{m['eval_loss_final']:.4f}",
                human_count(m["tokens"]),
                human_bytes(m["wire_bytes"]),
                str(m["syncs"]),
                f"{m['tokens_per_second']:.0f}",
            ]
        )
    table = fitted_table(columns, cells, width)
    lines: list[RenderableType] = [
        title,
        table,
        Text("loss: eval loss; DP: data-parallel; wire bytes: fp32, all learners", style="dim"),
    ]
    if result.get("loss_ratio") is not None:
        lines.append(
            Text(
                f"loss ratio DiLoCo/DP {result['loss_ratio']:.4f}   "
                f"bytes ratio DP/DiLoCo {result['bytes_ratio']:.1f}×"
            )
        )
    corpus = result["corpus"]
    lines.append(
        Text(
            f"data: {corpus['source']} ({corpus['documents']} documents, "
            f"{corpus['train_sequences']} train / {corpus['eval_sequences']} eval sequences, "
            f"tokenizer {corpus['tokenizer']}, fingerprint {corpus['fingerprint'][:12]})",
            style="dim",
        )
    )
    return Group(*lines)


def demo_summary(result: dict[str, Any], width: int = 80) -> RenderableType:
    """Loss, certified versions, committees and each node's accepted/rejected deltas."""
    drop = result["loss_start"] - result["loss_end"]
    head = Text.assemble(
        ("Local network demo", "bold"),
        f"  run {result['run_id'][:12]}  {result['seconds']:.0f} s\n",
        "eval loss ",
        (
            f"{result['loss_start']:.3f} → {result['loss_end']:.3f}",
            "bold green" if drop > 0 else "bold red",
        ),
        f"   certified versions {result['versions']}",
    )
    fragments = int(result.get("fragments", 1))
    committees = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    committees.add_column("version", justify="right", no_wrap=True)
    if fragments > 1:  # version v syncs fragment (v − 1) mod P (sync.fragments)
        committees.add_column("fragment", justify="right", no_wrap=True)
    committees.add_column("syncers (leader first)", overflow="fold")
    for v, members in sorted(result["committee"].items(), key=lambda kv: int(kv[0])):
        frag = [f"{(int(v) - 1) % fragments + 1} of {fragments}"] if fragments > 1 else []
        committees.add_row(str(v), *frag, ", ".join(short_peer_id(m) for m in members))
    columns = [
        Column("node"),
        Column("peer id", drop=2),
        Column("role", shrink=True, drop=1),
        Column("accepted", "right"),
        Column("rejected", "right"),
        Column("tokens", "right", drop=3),
        Column("compute", "right", drop=4),  # share of wall time in inner steps
    ]
    cells: list[list[Cell]] = [
        [
            name,
            short_peer_id(p["peer_id"]),
            Text(
                f"attacker ({p['adversary']})" if p["adversary"] else "honest",
                style="red" if p["adversary"] else "",
            ),
            str(p["accepted"]),
            str(p["rejected"]),
            human_count(p["tokens"]),
            f"{100 * p.get('utilization', 0.0):.0f}%",
        ]
        for name, p in result["peers"].items()
    ]
    return Group(
        head,
        Text("committee per version", style="bold"),
        committees,
        Text("deltas per node", style="bold"),
        fitted_table(columns, cells, width),
    )


SEVERITY_STYLE = {"ok": "green", "info": "blue", "warn": "yellow", "error": "bold red"}
# Below this width the four doctor columns would wrap a word per line: one block per finding.
FINDINGS_TABLE_MIN_WIDTH = 60


def findings_view(findings: list[dict[str, str]], width: int = 80) -> RenderableType:
    """``doctor``'s findings (``check``, ``severity``, ``detail``, ``fix``): a table with the
    detail and fix wrapped, or below 60 columns one block per finding."""
    if width < FINDINGS_TABLE_MIN_WIDTH:
        blocks: list[RenderableType] = [Text("p2pdiloco doctor", style="bold")]
        for f in findings:
            blocks.append(
                Text.assemble(
                    (f["check"], "bold"), " ", (f["severity"], SEVERITY_STYLE[f["severity"]])
                )
            )
            blocks.append(Padding(Text(f["detail"]), (0, 0, 0, 2)))
            if f["fix"]:
                blocks.append(Padding(Text(f"fix: {f['fix']}"), (0, 0, 0, 2)))
        return Group(*blocks)
    table = Table(box=box.SIMPLE_HEAD, title="p2pdiloco doctor", title_justify="left")
    table.add_column("check", style="bold", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("detail", overflow="fold")
    table.add_column("fix", overflow="fold")
    for f in findings:
        table.add_row(
            f["check"],
            Text(f["severity"], style=SEVERITY_STYLE[f["severity"]]),
            Text(f["detail"]),  # paths and messages are text, never markup
            Text(f["fix"]),
        )
    return table
