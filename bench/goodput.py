"""Goodput against synchronous data-parallel on the same failure schedules (issue 12).

Sweeps the failure rate per peer; each point simulates the run (``p2pdiloco.sim``: the real
round, learner, election and certificate code on simulated time) and data-parallel on the same
peers and the same faults, side by side. Goodput = tokens in certified versions ÷ tokens the
peers could have trained while up (``sim.run``); data-parallel is modelled generously
(``sim.dp``). Target: ≥ 95 % goodput where data-parallel is ≤ 30 %.

One failure schedule moves a point by a point or two either way (a committee member lost early,
say), so each point is the mean over ``--seeds`` schedules (seed, seed + 1, …), the range beside.

    .venv/bin/python bench/goodput.py                       # 64 peers, 2 simulated hours
    .venv/bin/python bench/goodput.py --peers 32 --hours 1 --mtbf 8,4,2 --json
    .venv/bin/python bench/goodput.py --staleness 0,2      # the manifest's staleness, side by side
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from p2pdiloco.sim import SimConfig, simulate_run

OUT = Path(__file__).parent / "out" / "goodput"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=64)
    ap.add_argument("--hours", type=float, default=2.0)
    ap.add_argument("--committee", type=int, default=8)
    ap.add_argument("--mtbf", default="none,64,16,12,10,8,6,5,4,3,2", help="hours between failures")
    ap.add_argument("--repair-minutes", type=float, default=10.0)
    ap.add_argument("--checkpoint-minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=16, help="failure schedules per point (mean)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--staleness", default="0", help="manifest staleness values (ADR 0026)")
    ap.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo fragments")
    a = ap.parse_args()
    stale = [int(v) for v in a.staleness.split(",")]
    rows: list[dict[str, Any]] = []
    for m, s in ((m, s) for m in a.mtbf.split(",") for s in stale):
        mtbf = None if m == "none" else float(m)
        runs = []
        for seed in range(a.seed, a.seed + a.seeds):
            cfg = SimConfig(
                peers=a.peers,
                duration=a.hours * 3600,
                committee_size=a.committee,
                mtbf_hours=mtbf,
                repair_seconds=a.repair_minutes * 60,
                seed=seed,
                rules={"staleness": s},
                fragments=a.fragments,
            )
            runs.append(simulate_run(cfg, checkpoint_seconds=a.checkpoint_minutes * 60)[0])
        rows.append(_row(runs, mtbf, s))
        r = rows[-1]
        met = "met" if r["data_parallel"] > 0.30 or r["diloco"] >= 0.95 else "MISSED"
        dp_g = float(r["data_parallel"])
        ratio = f"{float(r['diloco']) / dp_g:7.2f}x" if dp_g > 1e-3 else "    inf"
        print(
            f"mtbf {m:>5} h  staleness {s}  failures {r['failures']:4d}  DiLoCo {r['diloco']:6.1%} "
            f"({r['diloco_min']:.1%}–{r['diloco_max']:.1%})  "
            f"data-parallel {r['data_parallel']:6.1%}  ratio {ratio}  "
            f"views {r['view_changes']:3d}  p99 {r['latency_p99']:5.0f} s  [{met}]",
            flush=True,
        )
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "peers": a.peers,
        "hours": a.hours,
        "committee": a.committee,
        "repair_minutes": a.repair_minutes,
        "checkpoint_minutes": a.checkpoint_minutes,
        "seed": a.seed,
        "seeds": a.seeds,
        "staleness": stale,
    }
    (a.out / "goodput.json").write_text(json.dumps({"config": meta, "rows": rows}, indent=2))
    _plot(rows, meta, a.out)
    if a.json:
        json.dump({"config": meta, "rows": rows}, sys.stdout, indent=2)
    return 0


def _row(runs: list[Any], mtbf: float | None, staleness: int) -> dict[str, Any]:
    """One point: the mean over its failure schedules (failures and view changes summed)."""
    dps = [r.data_parallel for r in runs]
    assert all(dp is not None for dp in dps)
    good = [r.goodput for r in runs]
    return {
        "mtbf_hours": mtbf,
        "seeds": len(runs),
        "failures": sum(r.faults for r in runs),
        "diloco": statistics.fmean(good),
        "diloco_min": min(good),
        "diloco_max": max(good),
        "data_parallel": statistics.fmean(dp.goodput for dp in dps),
        "versions": statistics.fmean(r.versions for r in runs),
        "view_changes": sum(r.view_changes for r in runs),
        "dp_stalled_s": statistics.fmean(dp.stalled_seconds for dp in dps),
        "latency_p50": statistics.fmean(r.latency_p50 for r in runs),
        "latency_p99": max(r.latency_p99 for r in runs),
        "wall_s": sum(r.wall_seconds for r in runs),
        "staleness": staleness,
    }


def _plot(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = rows[0]["staleness"]  # the plot shows the first staleness asked for
    pts = [r for r in rows if r["mtbf_hours"] is not None and r["staleness"] == first]
    rate = [1 / float(r["mtbf_hours"]) for r in pts]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(rate, [float(r["diloco"]) for r in pts], "o-", label="p2pdiloco (simulated, mean)")
    if all("diloco_min" in r for r in pts):
        lo, hi = [float(r["diloco_min"]) for r in pts], [float(r["diloco_max"]) for r in pts]
        ax.fill_between(rate, lo, hi, alpha=0.2, label="range over failure schedules")
    ax.plot(
        rate, [float(r["data_parallel"]) for r in pts], "s--", label="synchronous data-parallel"
    )
    ax.axhline(0.95, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("failures per peer-hour (mean repair time fixed)")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{meta['peers']} peers, {meta['hours']} h, repair {meta['repair_minutes']} min")
    ax.legend(loc="lower left")
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(out / f"goodput.{ext}", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
