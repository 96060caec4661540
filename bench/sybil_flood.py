"""Issue 14's Sybil flood on real processes, side by side with a clean run.

Three honest nodes (the genesis committee) train to ``--until``; in the flooded run, from version
``--start``, five fresh identities send every syncer ±0.05 deltas with 10⁹-step claims
(``p2pdiloco.harness.sybil``). Prints each run's final eval loss (the certified state of node0 on
the embedded eval batches, as ``p2pdiloco demo`` measures it), the ratio to the clean run, and what
the certificates merged. Target: ratio ≤ 1.03, no fresh identity merged or elected. ``--no-trust``
puts trust out of reach (every identity counts as trusted, as before protocol 4).

    .venv/bin/python bench/sybil_flood.py
    .venv/bin/python bench/sybil_flood.py --until 15 --no-trust --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import DemoConfig
from p2pdiloco.harness.demo_summary import summarize
from p2pdiloco.harness.sybil import flood
from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.protocol.identity import Identity


def one_run(cfg: DemoConfig, workdir: Path, attack: bool, a: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    with LocalNetwork(workdir, cfg) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(3)]
        trust = 10**6 if a.no_trust else 2
        run_id = net.publish_run(keys, trust_min_accepted=trust, trust_min_age=2)
        nodes = [net.start_node(f"node{i}", k, until_version=a.until) for i, k in enumerate(keys)]
        sybils: set[str] = set()
        if attack:
            report = flood(net, run_id, nodes, start=a.start, until=a.until)
            sybils = set(report.sybils)
        statuses = net.wait_versions(a.until, nodes, 900)
        net.close()
        res = summarize(cfg, nodes, statuses, net.manifest, run_id, workdir, t0)
    certs = [
        parse_certificate(p.read_bytes(), run_id=run_id)
        for p in sorted((nodes[0].dir / "state" / "certs").glob("*.json"))
    ]
    return {
        "run": "flood" if attack else "clean",
        "versions": res.versions,
        "loss_start": res.loss_start,
        "loss_end": res.loss_end,
        "seconds": round(res.seconds, 1),
        "sybil_receipts": sum(x.peer_id in sybils for c in certs for x in c.body.accepted),
        "sybil_screened_out": sum(x.peer_id in sybils for c in certs for x in c.body.rejected),
        "sybil_seats": sum(len(sybils & set(c.body.committee)) for c in certs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=3)
    ap.add_argument("--until", type=int, default=10)
    ap.add_argument("--no-trust", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cfg = DemoConfig(nodes=3, committee_size=3, grace=15.0, agree_timeout=5.0)
    rows = []
    for attack in (False, True):
        with tempfile.TemporaryDirectory(prefix="p2pdiloco-sybil-") as d:
            rows.append(one_run(cfg, Path(d), attack, a))
        print(f"{rows[-1]['run']}: loss {rows[-1]['loss_end']:.4f}", file=sys.stderr, flush=True)
    for r in rows:
        r["loss_ratio_to_clean"] = r["loss_end"] / rows[0]["loss_end"]
    if a.json:
        print(json.dumps({"until": a.until, "trust": not a.no_trust, "runs": rows}, indent=2))
        return 0
    print(
        f"3 honest nodes, 5 fresh identities from v{a.start} to v{a.until}; trust "
        f"{'off' if a.no_trust else 'on'}"
    )
    print(f"{'run':<6} {'loss end':>9} {'vs clean':>9} {'merged':>7} {'screened':>9} {'seats':>6}")
    for r in rows:
        print(
            f"{r['run']:<6} {r['loss_end']:>9.4f} {r['loss_ratio_to_clean']:>9.3f} "
            f"{r['sybil_receipts']:>7} {r['sybil_screened_out']:>9} {r['sybil_seats']:>6}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
