"""Compute utilization of learners on the real local network, beside a learner without overlap.

Runs ``p2pdiloco demo`` (a bootstrap and N node processes on loopback) once and prints, per
learner, the share of its wall time spent in inner steps (measured: it keeps training while its
delta is merged, issue 10 item 2) beside the share a learner that blocked from each send to the
next certificate would have had: train / (train + wait), with the wait each node measured
(``sync_wait_s``: first send on a version to the next certified version, summed). Target: every
measured utilization ≥ 0.97.

    .venv/bin/python bench/utilization.py                 # 4 nodes, 5 rounds
    .venv/bin/python bench/utilization.py --rounds 8 --json
"""

from __future__ import annotations

import argparse
import json
import sys

from p2pdiloco.harness.demo import run_demo
from p2pdiloco.harness.demo_config import DemoConfig

TARGET = 0.97


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = run_demo(DemoConfig(nodes=a.nodes, rounds=a.rounds)).to_dict()
    rows = []
    for name, p in sorted(res["peers"].items()):
        train, wait = p["train_seconds"], p["sync_wait_s"]
        rows.append(
            {
                "node": name,
                "utilization": p["utilization"],
                "train_s": train,
                "sync_wait_s": wait,
                "without_overlap": round(train / (train + wait), 4) if train + wait else 0.0,
                "blocked_share_without_overlap": round(wait / (train + wait), 4)
                if train + wait
                else 0.0,
            }
        )
    ok = all(r["utilization"] >= TARGET for r in rows)
    if a.json:
        print(
            json.dumps(
                {
                    "versions": res["versions"],
                    "seconds": res["seconds"],
                    "rows": rows,
                    "target": TARGET,
                    "met": ok,
                },
                indent=2,
            )
        )
    else:
        print(f"{res['versions']} versions in {res['seconds']:.0f} s, {a.nodes} nodes")
        print(f"{'node':<6} {'utilization':>11} {'train s':>8} {'wait s':>7} {'no overlap':>10}")
        for r in rows:
            print(
                f"{r['node']:<6} {r['utilization']:>11.3f} {r['train_s']:>8.1f} "
                f"{r['sync_wait_s']:>7.1f} {r['without_overlap']:>10.3f}"
            )
        print(f"target utilization >= {TARGET}: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
