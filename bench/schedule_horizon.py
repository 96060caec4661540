"""The inner lr horizon of a run: planned from its size (ADR 0053) against a fixed horizon.

``simulate`` always ends its cosine after ``rounds × H`` steps, the rule ``run create --tokens``
now signs. Before it, every network run had 100 warm-up steps and a 10,000-step horizon: a run
of 100 rounds of H = 500 reached the lr floor after a fifth of its rounds. This bench trains
simulate's DiLoCo (no baseline) once per horizon, on the same tokens from the same init, with
the horizon overridden (``--fixed-share``: the fraction of the run after which the fixed
horizon ends, warm-up 1 % of it as 100 of 10,000), and prints the eval loss at a few rounds.

    .venv/bin/python bench/schedule_horizon.py                  # gemma-tiny, M 4, H 20, 30 rounds
    .venv/bin/python bench/schedule_horizon.py --fixed-share 0.2 --json

``--outer`` sweeps the outer momentum by run length instead (ADR 0060): for each planned
length R in ``--lengths``, simulate's DiLoCo on the planned inner schedule with outer momentum
0.9, 0.5 and the candidate rule ``candidate(R)`` = 1 − 2.5 / R within [0, 0.9] (0 in its place
where they coincide), outer lr 0.7, and prints the final eval loss of each:

    OMP_NUM_THREADS=1 nice .venv/bin/python bench/schedule_horizon.py --outer \
        --inner-steps 10 --batch-size 4 --seq-len 64 --lengths 5,10,20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from p2pdiloco.harness import simulate
from p2pdiloco.harness.simulate import SimulateConfig, run_simulation
from p2pdiloco.train.inner import InnerConfig
from p2pdiloco.train.outer import OuterConfig
from p2pdiloco.train.schedule import plan_run

OUTER_LR = 0.7  # the literature's, which run create signs


def candidate(rounds: int) -> float:
    """The length rule ADR 0060 evaluated (not adopted): momentum whose memory, 1 / (1 − β)
    rounds, is at most 2/5 of the run, within [0, 0.9]; 0.5 at 5 rounds as ADR 0006 found."""
    return round(min(0.9, max(0.0, 1.0 - 2.5 / rounds)), 2)


def run(a: argparse.Namespace, warmup: int, horizon: int) -> dict[str, Any]:
    cfg = SimulateConfig(
        model=a.model,
        learners=a.learners,
        inner_steps=a.inner_steps,
        rounds=a.rounds,
        seed=a.seed,
        baseline=False,
        inner=InnerConfig(warmup_steps=warmup, batch_size=a.batch_size, seq_len=a.seq_len),
        outer=OuterConfig(momentum=a.outer_momentum),
    )
    # simulate sets total_steps = rounds × H; this bench sets the horizon it compares.
    real = dataclasses.replace
    simulate.replace = lambda obj, **kw: real(obj, **{**kw, "total_steps": horizon})  # type: ignore[attr-defined]
    try:
        t0 = time.perf_counter()
        r = run_simulation(cfg)
    finally:
        simulate.replace = real  # type: ignore[attr-defined]
    losses = r.diloco.eval_losses
    return {
        "warmup_steps": warmup,
        "total_steps": horizon,
        "eval_loss_final": r.diloco.eval_loss_final,
        "eval_losses": losses,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def sweep_outer(a: argparse.Namespace) -> dict[str, Any]:
    """Final eval loss per (planned rounds, outer momentum), planned inner schedule each."""
    rows = []
    for rounds in (int(x) for x in a.lengths.split(",")):
        plan_run(  # the plan run create would sign: refuses a length it would refuse
            inner_steps=a.inner_steps,
            batch_size=a.batch_size,
            seq_len=a.seq_len,
            rounds=rounds,
            learners=a.learners,
        )
        signed = candidate(rounds)
        momenta = sorted({0.9, 0.5, signed} | ({0.0} if signed in (0.9, 0.5) else set()))
        for beta in momenta:
            cfg = SimulateConfig(
                model=a.model,
                learners=a.learners,
                inner_steps=a.inner_steps,
                rounds=rounds,
                seed=a.seed,
                baseline=False,
                inner=InnerConfig(
                    warmup_steps=max(1, rounds * a.inner_steps // 10),
                    batch_size=a.batch_size,
                    seq_len=a.seq_len,
                ),
                outer=OuterConfig(lr=OUTER_LR, momentum=beta),
            )
            t0 = time.perf_counter()
            r = run_simulation(cfg)
            rows.append(
                {
                    "rounds": rounds,
                    "momentum": beta,
                    "signed": beta == signed,
                    "eval_loss_final": r.diloco.eval_loss_final,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"command": " ".join(["bench/schedule_horizon.py", *sys.argv[1:]]), "outer": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-tiny")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--outer-momentum", type=float, default=0.5)  # short runs: ADR 0006
    ap.add_argument("--fixed-share", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--outer", action="store_true", help="sweep outer momentum by run length")
    ap.add_argument("--lengths", default="5,10,20", help="planned rounds for --outer")
    a = ap.parse_args()
    if a.outer:
        swept = sweep_outer(a)
        if a.json:
            print(json.dumps(swept))
            return 0
        print(f"{a.model}, M={a.learners}, H={a.inner_steps}, batch {a.batch_size}×{a.seq_len}")
        print("rounds  momentum  eval loss")
        for row in swept["outer"]:
            mark = "  ← candidate rule" if row["signed"] else ""
            print(
                f"{row['rounds']:>6}  {row['momentum']:>8.2f}  {row['eval_loss_final']:9.4f}{mark}"
            )
        return 0
    total = a.rounds * a.inner_steps
    fixed = max(2, round(total * a.fixed_share))
    out = {
        "command": " ".join(["bench/schedule_horizon.py", *sys.argv[1:]]),
        "planned": run(a, max(1, total // 10), total),
        "fixed": run(a, max(1, fixed // 100), fixed),
    }
    if a.json:
        print(json.dumps(out))
        return 0
    marks = sorted({a.rounds // 5, a.rounds // 2, a.rounds})
    print(f"{a.model}, M={a.learners}, H={a.inner_steps}, {a.rounds} rounds")
    print("schedule                     " + "  ".join(f"round {m:>3}" for m in marks))
    for name in ("planned", "fixed"):
        r = out[name]
        label = f"{name}: warm-up {r['warmup_steps']}, horizon {r['total_steps']}"
        print(f"{label:<29}" + "  ".join(f"{r['eval_losses'][m - 1]:9.4f}" for m in marks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
