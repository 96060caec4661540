"""DiLoCo against data-parallel at equal tokens on larger family members, cell by cell, one run.

Each cell is ``MODEL:CODEC:H:ROUNDS:BATCHxSEQ`` and runs ``p2pdiloco simulate``'s loop (the
syncer's own merge, each learner's codec with error feedback) beside the data-parallel baseline
on exactly the same tokens. Per cell it prints the eval-loss ratio DiLoCo / data-parallel, both
methods' tokens/s, peak device memory, and bytes:

- ``up_B_per_param``: encoded delta bytes a learner uploaded per parameter per round (counted:
  the sum of the payloads the codec produced);
- ``down_B_per_param``: 4 (the fp32 state a learner gets back; parameter-server accounting);
- ``dp_bf16_ring_B_per_param``: what one data-parallel worker sends per parameter in the same
  round, a bf16 ring all-reduce every inner step, 2 (M - 1) / M x 2 bytes x H (computed, not
  counted: no all-reduce runs here).

Written for a GPU (``--device cuda``: bf16 autocast), where no CPU test can reach these sizes:

    python bench/gpu_scale.py --device cuda --out bench/out/gpu \
        --cells gemma-small:int8:20:10:16x256,gemma-small:topk2:20:10:16x256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from p2pdiloco.harness.simulate import SimulateConfig, run_simulation
from p2pdiloco.train.inner import InnerConfig
from p2pdiloco.train.outer import OuterConfig


def run_cell(cell: str, a: argparse.Namespace) -> dict[str, object]:
    model, codec, h, rounds, shape = cell.split(":")
    batch, seq = (int(x) for x in shape.split("x"))
    H, R = int(h), int(rounds)
    cfg = SimulateConfig(
        model=model,
        learners=a.learners,
        inner_steps=H,
        rounds=R,
        seed=a.seed,
        device=a.device,
        tokenizer=a.tokenizer,
        eval_batches=a.eval_batches,
        compression=codec,
        inner=InnerConfig(
            lr=a.inner_lr, warmup_steps=max(1, H * R // 10), batch_size=batch, seq_len=seq
        ),
        # Short runs: 0.5 beats the literature's 0.9 (docs/adr/0006-short-run-outer-momentum.md).
        outer=OuterConfig(lr=0.7, momentum=a.outer_momentum),
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    r = run_simulation(cfg)
    assert r.baseline is not None and r.loss_ratio is not None
    P, M = r.parameters, r.learners
    down = R * M * P * 4
    up = r.diloco.wire_bytes - down
    up_per_param = up / (R * M * P)
    down_per_param = 4.0
    dp_ring = 2 * (M - 1) / M * 2 * H
    return {
        "cell": cell,
        "model": model,
        "parameters": P,
        "codec": codec,
        "device": r.device,
        "learners": M,
        "inner_steps": H,
        "rounds": R,
        "batch": batch,
        "seq_len": seq,
        "tokens_each_method": r.diloco.tokens,
        "eval_loss_initial": r.diloco.eval_loss_initial,
        "eval_loss_diloco": r.diloco.eval_loss_final,
        "eval_loss_data_parallel": r.baseline.eval_loss_final,
        "loss_ratio": r.loss_ratio,
        "diloco_curve": r.diloco.eval_losses,
        "data_parallel_curve": r.baseline.eval_losses,
        "tokens_per_s_diloco": r.diloco.tokens_per_second,
        "tokens_per_s_data_parallel": r.baseline.tokens_per_second,
        "peak_memory_gib": r.peak_memory_bytes / 2**30,
        "up_B_per_param": up_per_param,
        "down_B_per_param": down_per_param,
        "dp_bf16_ring_B_per_param": dp_ring,
        "dp_over_up": dp_ring / up_per_param,
        "dp_over_up_plus_down": 2 * dp_ring / (up_per_param + down_per_param),
        "seconds": time.perf_counter() - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", required=True, help="comma-separated MODEL:CODEC:H:ROUNDS:BxS")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--inner-lr", type=float, default=InnerConfig.lr)
    ap.add_argument("--outer-momentum", type=float, default=0.5)
    ap.add_argument("--tokenizer", default=None, help="e.g. byte for the published sizes")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu_scale"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for cell in a.cells.split(","):
        try:
            row = run_cell(cell, a)
        # One failed cell (memory, a missing tokenizer) is reported, not fatal.
        except Exception as e:
            row = {"cell": cell, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (a.out / "gpu_scale.json").write_text(json.dumps(rows, indent=2))
    print(
        f"\n{'cell':42} {'loss ratio':>10} {'tok/s DiLoCo':>12} {'tok/s DP':>10} "
        f"{'peak GiB':>8} {'up B/param':>10} {'DP/up':>8} {'DP/(up+down)':>12}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['cell']:42} {row['error']}")
            continue
        print(
            f"{row['cell']:42} {row['loss_ratio']:10.4f} {row['tokens_per_s_diloco']:12.0f} "
            f"{row['tokens_per_s_data_parallel']:10.0f} {row['peak_memory_gib']:8.2f} "
            f"{row['up_B_per_param']:10.4f} {row['dp_over_up']:8.0f} {row['dp_over_up_plus_down']:12.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
