"""The figure of ``bench/chaos.py``: certified version against time with the kill and restart
marks; below it, when each node (and the bootstrap) was down."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.chaos_verify import BOOTSTRAP


def plot(res: dict[str, Any], stem: Path, dpi: int = 110) -> list[Path]:
    """Certified version against time with the kill/restart marks; below, each node's lives."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, lanes) = plt.subplots(
        2, 1, sharex=True, figsize=(9, 5.2), gridspec_kw={"height_ratios": [3, 1.6]}
    )
    end = res["chaos_seconds"]
    cert = sorted((t, int(v)) for v, t in res["cert_times"].items() if t <= end)
    if cert:
        ts, vs = zip(*cert, strict=True)
        ax.step(
            [0.0, *ts, end],
            [res["versions"]["at_start"], *vs, vs[-1]],
            where="post",
            color="black",
            lw=1.6,
            label="certified version (network)",
        )
    for _, node_pts in sorted(res["versions_by_node"].items()):
        pts = [(t, v) for t, v in node_pts if t <= end]
        if pts:
            ts, vs = zip(*pts, strict=True)
            ax.step(ts, vs, where="post", lw=0.6, alpha=0.5)
    for g in res["stalls"]:
        ax.axvspan(g["start"], g["start"] + g["seconds"], color="tab:red", alpha=0.12)
    names = sorted(res["versions_by_node"]) + [BOOTSTRAP]
    for e in res["executed"]:
        colour = (
            "tab:purple"
            if e["target"] == BOOTSTRAP
            else ("tab:red" if e["action"] == "kill" else "tab:green")
        )
        ax.axvline(e["t_actual"], color=colour, lw=0.7, ls="--" if e["action"] == "kill" else ":")
    down: dict[str, float] = {}
    for e in res["executed"]:
        if e["action"] == "kill":
            down[e["target"]] = e["t_actual"]
        elif e["target"] in down:
            start = down.pop(e["target"])
            lanes.broken_barh(
                [(start, e["t_actual"] - start)],
                (names.index(e["target"]) - 0.4, 0.8),
                color="tab:red",
            )
    for x in res["exits"]:
        back = [
            e["t_actual"]
            for e in res["executed"]
            if e["target"] == x["node"] and e["action"] == "restart" and e["t_actual"] >= x["t"]
        ]
        lanes.broken_barh(
            [(x["t"], (back[0] if back else end) - x["t"])],
            (names.index(x["node"]) - 0.4, 0.8),
            color="tab:gray",
        )
    for r in res["restarts"]:
        width = r["rejoin_s"] if r["rejoin_s"] is not None else min(r["until"], end) - r["t"]
        lanes.broken_barh(
            [(r["t"], width)], (names.index(r["node"]) - 0.4, 0.8), color="tab:orange"
        )
    lanes.set_yticks(range(len(names)), names, fontsize=7)
    lanes.set_ylim(-0.7, len(names) - 0.3)
    lanes.set_xlim(0, end)
    lanes.set_xlabel("seconds after the chaos began")
    lanes.set_title(
        "down (red: killed; grey: exited on its own; "
        "orange: restarting until at the newest version)",
        fontsize=8,
    )
    gp = res["goodput"]
    t = res["targets"]
    ax.set_ylabel("version")
    ax.set_title(
        f"{len(names) - 1} nodes, {res['versions']['certified']} versions in {end:.0f} s; "
        f"stalls {t['stalls_past_grace']} (max gap {res['max_gap_s']:.0f} s, allowance "
        f"{res['stall_allowance_s']:.0f} s), lost {t['lost_versions']}, corrupt "
        f"{t['corrupt_states']}; goodput {gp['goodput']:.2f}",
        fontsize=8,
    )
    ax.plot([], [], color="tab:red", ls="--", lw=0.7, label="node SIGKILL")
    ax.plot([], [], color="tab:green", ls=":", lw=0.7, label="node restart")
    ax.plot([], [], color="tab:purple", lw=0.7, label="bootstrap kill / restart")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    for p in paths:
        fig.savefig(p, dpi=dpi)
    plt.close(fig)
    return paths
