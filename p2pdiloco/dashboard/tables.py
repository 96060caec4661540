"""Tables for ``models`` and ``simulate``: pure functions from results to rich renderables."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

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


def models_table(rows: list[dict[str, Any]], precisions: list[str]) -> Table:
    """One row per model: size, shape, and training memory per precision."""
    table = Table(
        title="Registered models: training memory per learner",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("model", style="bold", no_wrap=True)
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("shape", justify="right", no_wrap=True)
    table.add_column("batch", justify="right", no_wrap=True)
    for p in precisions:
        table.add_column(p, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            r["name"],
            human_count(r["parameters"]),
            f"{r['num_layers']}×{r['hidden_size']}",
            f"{r['train_micro_batch']}×{r['train_seq_len']}",
            *(f"{r['memory'][p]['total'] / GiB:.1f} GiB" for p in precisions),
        )
    return table


def simulation_summary(result: dict[str, Any]) -> Group:
    """Final table of a simulate run: both methods at equal tokens, plus the ratios."""
    table = Table(
        title=(
            f"{result['model']} ({human_count(result['parameters'])} params) on "
            f"{result['device']}: {result['learners']} learners, H={result['inner_steps']}, "
            f"{result['rounds']} rounds, {result['fragments']} fragment(s)"
        ),
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("method", "loss start", "loss end", "tokens", "wire bytes", "syncs", "tok/s"):
        table.add_column(name, justify="left" if name == "method" else "right", no_wrap=True)
    for key in ("diloco", "baseline"):
        m = result.get(key)
        if m is None:
            continue
        table.add_row(
            "DiLoCo" if key == "diloco" else "data-parallel",
            f"{m['eval_loss_initial']:.4f}",
            f"{m['eval_loss_final']:.4f}",
            human_count(m["tokens"]),
            human_bytes(m["wire_bytes"]),
            str(m["syncs"]),
            f"{m['tokens_per_second']:.0f}",
        )
    lines: list[RenderableType] = [
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


def demo_summary(result: dict[str, Any]) -> RenderableType:
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
    committees = Table(box=box.SIMPLE_HEAD, title="committee per version", title_justify="left")
    committees.add_column("version", justify="right")
    committees.add_column("syncers (leader first)")
    for v, members in sorted(result["committee"].items(), key=lambda kv: int(kv[0])):
        committees.add_row(str(v), ", ".join(members))
    peers = Table(box=box.SIMPLE_HEAD, title="deltas per node", title_justify="left")
    for col in ("node", "peer id", "role", "accepted", "rejected", "tokens"):
        peers.add_column(
            col, justify="right" if col in ("accepted", "rejected", "tokens") else "left"
        )
    for name, p in result["peers"].items():
        role = f"attacker ({p['adversary']})" if p["adversary"] else "honest"
        peers.add_row(
            name,
            "…" + p["peer_id"][-10:],
            Text(role, style="red" if p["adversary"] else ""),
            str(p["accepted"]),
            str(p["rejected"]),
            human_count(p["tokens"]),
        )
    return Group(head, committees, peers)
