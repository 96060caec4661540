"""The simulator's prediction for a chaos run (``bench/chaos.py``), beside what was measured.

Reads a chaos JSON and simulates the same network (``p2pdiloco.sim``): as many peers, the
manifest's committee, H, batch and rules, each node's measured tokens per second, and the kill
and restart times that were actually executed (a kill is a failure, its restart the repair;
the simulated restart takes the median measured time to rejoin). A round's costs on the
machine come from the run's logs (``timings``, ``bench/chaos_timings.py``): the merge time per
input and the time for a certificate to be applied. Older JSONs lack them; the simulator's
defaults (20 ms, and at once) stand in. Links are loopback: fast and near zero latency. The bootstrap's outage is not modelled (the simulator has no bootstrap).
Prints both goodputs with chaos.py's definition (credited tokens ÷ every node's speed × the
chaos time) and writes ``simulator_prediction`` into the JSON.

    .venv/bin/python bench/chaos_predict.py bench/out/chaos/chaos-s0.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.sim import SimConfig, simulate_run
from p2pdiloco.sim.config import Fault

# The run's linger: chaos JSONs before 2026-11-27 (stop 33) lack it, and their runs had the
# manifest default. Earlier predictions used 0.3 s, a tenth of what the run had.
LINGER = SyncRules().linger


def predict(run: dict) -> dict:  # type: ignore[type-arg]
    cfg_in, man = run["config"], run["manifest"]
    nodes = cfg_in["nodes"]
    tokens_per_step = man["batch_size"] * man["seq_len"]
    rate = run["goodput"]["tokens_per_second"]
    step_seconds = {i: tokens_per_step / rate[f"node{i}"] for i in range(nodes)}
    faults = [
        Fault(
            e["t_actual"],
            int(e["target"].removeprefix("node")),
            "down" if e["action"] == "kill" else "up",
        )
        for e in run["executed"]
        if e["target"].startswith("node") and e["t_actual"] < run["chaos_seconds"]
    ]
    rejoin = [r["rejoin_s"] for r in run["restarts"] if r.get("rejoin_s")]
    measured = run.get("timings") or {}  # bench/chaos_timings.py; absent in older JSONs
    merge_s = measured.get("merge_s_per_input") or SimConfig.merge_seconds_per_input
    apply_s = measured.get("apply_s") or 0.0
    cfg = SimConfig(
        peers=nodes,
        committee_size=man["committee_size"],
        duration=run["chaos_seconds"],
        inner_steps=man["inner_steps"],
        time_budget=0,
        batch_size=man["batch_size"],
        seq_len=man["seq_len"],
        payload_bytes=1_100_000,
        update_bytes=1_100_000,
        state_bytes=8_500_000,
        up_mbps=8000,
        down_mbps=8000,
        bw_sigma=0.0,
        latency_ms=(0.1, 0.5),
        restart_seconds=statistics.median(rejoin) if rejoin else 30.0,
        rules={
            "grace": man["grace"],
            "agree_timeout": man["agree_timeout"],
            "view_timeout": man["view_timeout"],
            "linger": man.get("linger", LINGER),
            "min_quorum_fraction": man["min_quorum_fraction"],
        },
        fragments=man.get("fragments", 1),
        merge_seconds_per_input=merge_s,
        apply_seconds=apply_s,
    )
    result, _ = simulate_run(cfg, baseline=False, faults=faults, step_seconds=step_seconds)
    return {
        "goodput": round(result.credited_tokens / result.all_time_tokens, 4),
        "versions": result.versions,
        "view_changes": result.view_changes,
        "restart_seconds": cfg.restart_seconds,
        "merge_seconds_per_input": merge_s,
        "apply_seconds": apply_s,
        "note": "same nodes, speeds, kill/restart times and manifest; bootstrap outage and "
        "process start-up noise not modelled; loopback links",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+")
    a = ap.parse_args()
    for path in a.runs:
        run = json.loads(path.read_text())
        pred = predict(run)
        run["simulator_prediction"] = pred
        path.write_text(json.dumps(run, indent=2))
        print(
            f"{path.name}: measured goodput {run['goodput']['goodput']:.3f} "
            f"({run['versions']['certified']} versions), simulator {pred['goodput']:.3f} "
            f"({pred['versions']} versions, {pred['view_changes']} view changes)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
