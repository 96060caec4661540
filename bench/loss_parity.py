"""Loss parity and wire bytes: DiLoCo vs data-parallel at equal tokens, in one run.

Prints the eval-loss ratio DiLoCo / data-parallel (target ≤ 1.02) and the bytes ratio
data-parallel / DiLoCo (target ≥ H before compression). Both methods train from the same init on
exactly the same tokens, side by side in one process, so machine noise cannot favour either.

    .venv/bin/python bench/loss_parity.py                    # defaults below
    .venv/bin/python bench/loss_parity.py --rounds 20 --json # longer, machine-readable
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from p2pdiloco.harness.simulate import SimulateConfig, run_simulation
from p2pdiloco.train.inner import InnerConfig
from p2pdiloco.train.outer import OuterConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-tiny")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--inner-lr", type=float, default=InnerConfig.lr)
    ap.add_argument("--outer-lr", type=float, default=OuterConfig.lr)
    # Short runs: 0.5 beats the literature's 0.9 (docs/adr/0006-short-run-outer-momentum.md).
    ap.add_argument("--outer-momentum", type=float, default=0.5)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    total = a.rounds * a.inner_steps
    cfg = SimulateConfig(
        model=a.model,
        learners=a.learners,
        inner_steps=a.inner_steps,
        rounds=a.rounds,
        seed=a.seed,
        device=a.device,
        inner=InnerConfig(
            lr=a.inner_lr,
            warmup_steps=max(1, total // 10),
            batch_size=a.batch_size,
            seq_len=a.seq_len,
        ),
        outer=OuterConfig(lr=a.outer_lr, momentum=a.outer_momentum, fragments=a.fragments),
    )
    t0 = time.perf_counter()
    r = run_simulation(cfg)
    assert r.baseline is not None and r.loss_ratio is not None and r.bytes_ratio is not None
    out = {
        "command": " ".join(["bench/loss_parity.py", *sys.argv[1:]]),
        "model": r.model,
        "device": r.device,
        "learners": r.learners,
        "inner_steps": r.inner_steps,
        "rounds": r.rounds,
        "tokens_each": r.diloco.tokens,
        "eval_loss_diloco": r.diloco.eval_loss_final,
        "eval_loss_data_parallel": r.baseline.eval_loss_final,
        "loss_ratio": r.loss_ratio,
        "bytes_ratio": r.bytes_ratio,
        "diloco_curve": r.diloco.eval_losses,
        "data_parallel_curve": r.baseline.eval_losses,
        "seconds": time.perf_counter() - t0,
    }
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"{r.model} M={r.learners} H={r.inner_steps} rounds={r.rounds} "
            f"tokens={r.diloco.tokens} each on {r.device}"
        )
        print(
            f"eval loss  DiLoCo {r.diloco.eval_loss_final:.4f}  "
            f"data-parallel {r.baseline.eval_loss_final:.4f}"
        )
        print(f"loss ratio  DiLoCo/data-parallel = {r.loss_ratio:.4f}   (target <= 1.02)")
        print(
            f"bytes ratio data-parallel/DiLoCo = {r.bytes_ratio:.1f}x   (target >= H = {a.inner_steps})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
