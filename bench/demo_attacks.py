"""Each attack against the real local network, side by side with a clean run.

Runs ``p2pdiloco demo`` (a bootstrap and N node processes on loopback) once clean and once per
attack kind with the last node attacking, and prints each run's final eval loss as a ratio to
the clean run's, and what the committee did with the attacker's deltas. Target: every ratio
≤ 1.05 (loss within a few percent of the clean run), attacker deltas rejected or neutralized.

    .venv/bin/python bench/demo_attacks.py                      # 4 nodes, 3 rounds, all attacks
    .venv/bin/python bench/demo_attacks.py --attacks sign-flip,alie --rounds 5 --json
"""

from __future__ import annotations

import argparse
import json
import sys

from p2pdiloco.harness.demo import run_demo
from p2pdiloco.harness.demo_config import DemoConfig
from p2pdiloco.train.attacks import ATTACKS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--aggregation", default="trimmed_mean")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    kinds = [k for k in a.attacks.split(",") if k]
    rows = []
    for kind in [None, *kinds]:
        cfg = DemoConfig(nodes=a.nodes, rounds=a.rounds, adversary=kind, aggregation=a.aggregation)
        res = run_demo(cfg).to_dict()
        bad = res["peers"][f"node{a.nodes - 1}"]
        rows.append(
            {
                "attack": kind or "clean",
                "versions": res["versions"],
                "loss_start": res["loss_start"],
                "loss_end": res["loss_end"],
                "seconds": res["seconds"],
                "attacker_accepted": bad["accepted"] if kind else None,
                "attacker_rejected": bad["rejected"] if kind else None,
            }
        )
        print(f"{rows[-1]['attack']}: loss {res['loss_end']:.4f}", file=sys.stderr, flush=True)
    clean = rows[0]["loss_end"]
    for r in rows:
        r["loss_ratio_to_clean"] = r["loss_end"] / clean
    if a.json:
        print(json.dumps({"nodes": a.nodes, "rounds": a.rounds, "runs": rows}, indent=2))
        return 0
    print(f"{a.nodes} nodes, {a.rounds} rounds, rule {a.aggregation}; last node attacks")
    print(
        f"{'attack':<10} {'versions':>8} {'loss end':>9} {'vs clean':>9} {'attacker acc/rej':>17}"
    )
    for r in rows:
        verdict = (
            f"{r['attacker_accepted']}/{r['attacker_rejected']}" if r["attack"] != "clean" else "-"
        )
        print(
            f"{r['attack']:<10} {r['versions']:>8} {r['loss_end']:>9.4f} "
            f"{r['loss_ratio_to_clean']:>9.3f} {verdict:>17}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
