"""Which merge rules stay meaningful on sparse deltas: codec × rule × attack, side by side.

Every cell is one ``p2pdiloco simulate`` run (M learners in one process, the syncer's real
screening and merge, each learner's delta through its own error feedback and the codec, an
omniscient attacker as the last learner), all on the same data, seed and schedule. It prints
each run's final eval loss as a ratio to the clean run of the same codec with plain mean, and
the share of honest deltas the merge accepted.

    .venv/bin/python bench/sparse_rules.py                          # int8 and topk2, 4 rules
    .venv/bin/python bench/sparse_rules.py --codecs topk2 --rules median --attacks alie --json

Read with docs/adr/0018-sparse-codec.md: a coordinate-wise rule (median, trimmed mean) sees
mostly zeros where only a few learners kept an entry, so it shrinks the update; a rule that
picks or re-weights whole deltas (Krum, centred clipping) does not.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from p2pdiloco.harness.simulate import SimulateConfig, run_simulation
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.train.inner import InnerConfig
from p2pdiloco.train.outer import OuterConfig

RULE_PARAMS = {
    "mean": {},
    "trimmed_mean": {"f": 1},
    "median": {},
    "multi_krum": {"f": 1},
    "centered_clip": {"tau": 1.0, "relative": 1.0},  # the manifest holds numbers: 1 = True
    "geometric_median": {},
}


def corpus(root: Path) -> Path:
    words = "the model learns what the data says when every learner reads its own shard. "
    for i in range(16):
        (root / f"doc{i}.txt").write_text(f"Document number {i}. " + words * 200)
    return root


def run(data: Path, a: argparse.Namespace, codec: str, rule: str, attack: str | None) -> dict:
    cfg = SimulateConfig(
        learners=a.learners,
        inner_steps=a.inner_steps,
        rounds=a.rounds,
        data=str(data),
        baseline=False,
        eval_batches=4,
        compression=codec,
        rules=SyncRules(aggregation=rule, aggregation_params=RULE_PARAMS[rule]),
        adversaries=1 if attack else 0,
        attack=attack or "sign-flip",
        inner=InnerConfig(lr=3e-3, warmup_steps=2, batch_size=4, seq_len=64),
        outer=OuterConfig(lr=0.7, momentum=0.5),
    )
    t0 = time.perf_counter()
    res = run_simulation(cfg).to_dict()
    honest = range(a.learners - (1 if attack else 0))
    merged = sum(res["accepted_deltas"][i] for i in honest)
    return {
        "codec": codec,
        "rule": rule,
        "attack": attack or "clean",
        "loss": res["diloco"]["eval_loss_final"],
        "loss_initial": res["diloco"]["eval_loss_initial"],
        "honest_accepted": merged / (len(honest) * a.rounds),
        "wire_bytes": res["diloco"]["wire_bytes"],  # upload as encoded + fp32 download
        "seconds": time.perf_counter() - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", default="int8,topk2")
    ap.add_argument("--rules", default="mean,trimmed_mean,median,multi_krum")
    ap.add_argument("--attacks", default="sign-flip,alie")
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus(Path(tmp))
        for codec in a.codecs.split(","):
            clean = run(data, a, codec, "mean", None)
            rows.append(clean)
            for rule in a.rules.split(","):
                for attack in [None, *(x for x in a.attacks.split(",") if x)]:
                    if rule == "mean" and attack is None:
                        continue
                    rows.append(run(data, a, codec, rule, attack))
            for r in rows:
                if r["codec"] == codec:
                    r["loss_ratio"] = r["loss"] / clean["loss"]
            print(f"{codec} done", file=sys.stderr)
    if a.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"{'codec':6} {'rule':14} {'attack':10} {'loss':>7} {'÷ clean mean':>13} {'honest in':>9}"
    )
    for r in rows:
        print(
            f"{r['codec']:6} {r['rule']:14} {r['attack']:10} {r['loss']:7.3f} "
            f"{r['loss_ratio']:13.3f} {r['honest_accepted']:9.0%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
