"""The network simulator at scale: up to 10,000 heterogeneous peers with churn (issue 12).

Each point simulates one hour (``p2pdiloco.sim``, metadata mode: the real round, learner,
election, trust and certificate code, no tensors) and reports goodput, the time from a round's
opening to its certificate (p50/p95/p99), bytes per learner and per syncer, committee failures
(view changes, failed merges, wrong or conflicting certificates) and the wall time the
simulation took. Target: goodput ≥ 90 % at 10,000 peers, the hour simulated in < 10 minutes.

The run syncs 50 Streaming DiLoCo fragments (ADR 0050): each round moves and merges a fiftieth
of the model, and each row says how often a fragment is synced (the run's effective H in
seconds of training). ``--fragments 1`` is plain DiLoCo, one round per whole-model sync.

    .venv/bin/python bench/netsim_scale.py                          # 100, 1000, 10000 peers
    .venv/bin/python bench/netsim_scale.py --peers 100,1000 --minutes 20 --json
    .venv/bin/python bench/netsim_scale.py --fragments 1            # plain DiLoCo

``--shards S`` is a projection, not the protocol: the protocol has one committee per version.
It simulates what one of the S parameter-shard committees of the proposed ADR 0033 would see
(``--committee`` members, each delta, update and state 1/S of the model, merges 1/S as long),
as if the S committees ran independently and credited each delta per shard. It says which
limits bind once the relay uplinks no longer do, before the shards are built.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from p2pdiloco.sim import SimConfig, simulate_run

OUT = Path(__file__).parent / "out" / "netsim_scale"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="100,1000,10000")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--committee", type=int, default=16)
    ap.add_argument("--churn", type=float, default=0.1, help="share of peers replaced per hour")
    ap.add_argument("--mtbf", type=float, default=24.0, help="hours between failures per peer")
    ap.add_argument("--payload-mb", type=float, default=1.0, help="one compressed delta")
    ap.add_argument("--linger", type=float, default=20.0)
    ap.add_argument("--fragments", type=int, default=50, help="Streaming DiLoCo fragments")
    ap.add_argument("--grace", type=float, help="round grace, s (default: 1.5 stretches, ≥ 60)")
    ap.add_argument("--shards", type=int, default=1, help="project one of S shard committees")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for n in (int(x) for x in a.peers.split(",")):
        cfg = SimConfig(
            peers=n,
            duration=a.minutes * 60,
            committee_size=a.committee,
            churn_per_hour=a.churn,
            mtbf_hours=a.mtbf,
            payload_bytes=int(a.payload_mb * 1e6 / a.shards),
            update_bytes=int(a.payload_mb * 1e6 / a.shards),
            state_bytes=50_000_000 // a.shards,
            down_mbps=1000.0,
            merge_seconds_per_input=0.02 / a.shards,
            fragments=a.fragments,
            rules={"linger": a.linger, **({"grace": a.grace} if a.grace else {})},
            seed=a.seed,
        )
        r, _ = simulate_run(cfg, baseline=False)
        # How often each fragment is synced: with P fragments, every P versions (its steps
        # between syncs, the run's effective H, are this many seconds of training).
        every = a.fragments * r.duration / max(1, r.versions)
        rows.append({**r.to_dict(), "fragments": a.fragments, "fragment_sync_seconds": every})
        print(
            f"{n:6d} peers  goodput {r.goodput:6.1%}  versions {r.versions:4d}  "
            f"latency p50/p95/p99 "
            f"{r.latency_p50:4.0f}/{r.latency_p95:4.0f}/{r.latency_p99:4.0f} s  "
            f"MB/learner/delta {r.learner_bytes_per_delta / 1e6:6.1f}  "
            f"cert max MB {r.certificate_bytes_max / 1e6:4.2f}  "
            f"MB/syncer/round {r.syncer_bytes_per_round / 1e6:8.1f}  views {r.view_changes}  "
            f"fragment synced every {every:4.0f} s  "
            f"wrong {r.wrong_certificates + r.conflicts}  wall {r.wall_seconds:5.0f} s",
            flush=True,
        )
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(a).items() if k not in ("out", "json")}
    (a.out / "netsim_scale.json").write_text(json.dumps({"config": meta, "rows": rows}, indent=2))
    _plot(rows, a.out)
    if a.json:
        json.dump({"config": meta, "rows": rows}, sys.stdout, indent=2)
    return 0


def _plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = [int(r["peers"]) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for q in ("latency_p50", "latency_p95", "latency_p99"):
        ax1.plot(peers, [float(r[q]) for r in rows], "o-", label=q.split("_")[1])
    ax1.set_xscale("log")
    ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.set_xlabel("peers")
    ax1.set_ylabel("round open → certificate (s)")
    ax1.legend()
    ax2.plot(peers, [float(r["goodput"]) for r in rows], "o-")
    ax2.axhline(0.9, color="grey", lw=0.6, ls=":")
    ax2.set_xscale("log")
    ax2.set_ylim(0, 1.02)
    ax2.set_xlabel("peers")
    ax2.set_ylabel("goodput")
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(out / f"netsim_scale.{ext}", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
