"""Bytes per learner per round on a real local network, against bf16 data-parallel.

A bootstrap and ``--nodes`` ``join`` processes train gemma-tiny on loopback (``LocalNetwork``,
the demo's network). Every node counts the sync protocol's frames it sends and receives
(``net.sync_rpc.TRAFFIC``: submissions, proposals, signatures, state downloads; not the DHT,
gossip or libp2p framing) and reports them in its status file. Between the first certified
version and ``--versions``, each node's upload and download are divided by the versions it
applied; the table gives the mean over nodes. Every node is a learner, and the committee is
drawn from them, so a node's bytes include its turns as a syncer.

Data-parallel reference at equal tokens: a bf16 ring all-reduce of the P parameters sends and
receives 2 × (N − 1) / N × 2 × P bytes per learner per step, H steps per round.

    .venv/bin/python bench/bytes.py                              # int8, H = 20, 4 nodes
    .venv/bin/python bench/bytes.py --codec int8 --codec topk2 --inner-steps 20 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2pdiloco.demo import DemoConfig, LocalNetwork
from p2pdiloco.protocol.identity import Identity


def param_count(model: str) -> int:
    from p2pdiloco.train.models import build_model, param_state

    return sum(t.numel() for t in param_state(build_model(model, seed=0)).values())


def measure(a: argparse.Namespace, codec: str, workdir: Path) -> dict[str, Any]:
    cfg = DemoConfig(
        nodes=a.nodes, inner_steps=a.inner_steps, compression=codec, batch_size=4, seq_len=64,
        grace=30.0, agree_timeout=10.0, committee_size=min(4, a.nodes),
    )  # fmt: skip
    t0 = time.monotonic()
    with LocalNetwork(workdir, cfg) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(a.nodes)]
        net.publish_run(keys)
        nodes = [
            net.start_node(f"node{i}", k, until_version=a.versions + 1) for i, k in enumerate(keys)
        ]
        first = net.wait_versions(1, nodes, a.timeout)
        last = net.wait_versions(a.versions, nodes, a.timeout)
    ups, downs = [], []
    for s0, s1 in zip(first, last, strict=True):
        rounds = max(1, int(s1["version"]) - int(s0["version"]))
        ups.append((s1["bytes_up"] - s0["bytes_up"]) / rounds)
        downs.append((s1["bytes_down"] - s0["bytes_down"]) / rounds)
    return {
        "codec": codec,
        "up": statistics.mean(ups),
        "down": statistics.mean(downs),
        "seconds": time.monotonic() - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=20, help="H")
    ap.add_argument("--versions", type=int, default=4, help="certified versions to reach")
    ap.add_argument("--codec", action="append", help="repeatable; default int8")
    ap.add_argument("--model", default="gemma-tiny")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.nodes < 2 or a.versions < 2 or a.inner_steps < 1:
        ap.error("need --nodes >= 2, --versions >= 2, --inner-steps >= 1")
    codecs = a.codec or ["int8"]
    p = param_count(a.model)
    n = a.nodes
    dp = 2 * (n - 1) / n * 2 * p * a.inner_steps  # bf16 ring all-reduce, one way, per round
    rows = []
    for codec in codecs:
        with tempfile.TemporaryDirectory(prefix="p2pdiloco-bytes-") as tmp:
            r = measure(a, codec, Path(tmp))
        r["dp_one_way"] = dp
        r["up_vs_dp"] = dp / r["up"] if r["up"] else None
        r["down_vs_dp"] = dp / r["down"] if r["down"] else None
        r["up_bytes_per_param"] = r["up"] / p
        r["down_bytes_per_param"] = r["down"] / p
        rows.append(r)
    out = {
        "command": " ".join(["bench/bytes.py", *sys.argv[1:]]),
        "model": a.model,
        "params": p,
        "nodes": n,
        "inner_steps": a.inner_steps,
        "rows": rows,
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{a.model} ({p:,} parameters), {n} nodes, H = {a.inner_steps}; per learner per round")
    print(f"bf16 data-parallel ring all-reduce: {dp / 1e6:.2f} MB each way")
    print(f"{'codec':8} {'up MB':>9} {'down MB':>9} {'up B/param':>11} {'down B/param':>13} "
          f"{'DP/up':>7} {'DP/down':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['codec']:8} {r['up'] / 1e6:9.2f} {r['down'] / 1e6:9.2f} "
            f"{r['up_bytes_per_param']:11.2f} {r['down_bytes_per_param']:13.2f} "
            f"{r['up_vs_dp']:6.1f}x {r['down_vs_dp']:7.1f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
