"""Throughput of an island: tokens per second, model FLOPs utilization, and where a step goes.

Trains the run's step batch on islands of 1, 2, ... ranks (rank 0 in this process, members as
real processes through the island's command channel, exactly as ``join`` does) and splits the
time into: inner steps (of which island collectives: FSDP2's all-gathers and reduce-scatters,
from the profiler), and per round, delta extraction (gathering the full parameters onto rank 0
and compressing Δ) and loading a certified version (scatter). So the network round's overhead
beside the inner loop is visible. Measured side by side in one run.

    .venv/bin/python bench/island.py                              # CPU, gloo, gemma-tiny
    .venv/bin/python bench/island.py --ranks 1,2,4 --steps 8 --json
    .venv/bin/python bench/island.py --model gemma-1b --device cuda --gpus 0,1 --peak-tflops 989

MFU = 6 × parameters × tokens per second ÷ (ranks × peak FLOP/s of one device), the usual
dense-transformer count (attention's sequence term left out); printed only with a peak given
(an H100 SXM: 989 bf16 TFLOP/s dense).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from p2pdiloco.island.learner import IslandLearner
from p2pdiloco.island.spec import IslandSpec
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.train.data import build_corpus
from p2pdiloco.train.learner import Learner
from p2pdiloco.train.model_specs import get_spec, parameter_count
from p2pdiloco.train.tokenizer import load_tokenizer

COLLECTIVE = ("c10d::", "allgather", "all_gather", "reduce_scatter", "allreduce", "nccl")


def _collective_seconds(prof: Any) -> float:
    """Self time of the collective ops rank 0 saw (CPU ops for gloo, kernels for NCCL)."""
    total_us = 0.0
    for evt in prof.key_averages():
        if any(k in evt.key.lower() for k in COLLECTIVE):
            total_us += max(evt.self_cpu_time_total, getattr(evt, "self_device_time_total", 0))
    return total_us / 1e6


def measure(learner: Learner, base: dict[str, torch.Tensor], steps: int, cuda: bool) -> dict:
    learner.train(1)  # warm-up: allocations, first collectives
    t0 = time.perf_counter()
    stats = learner.train(steps)
    train_s = time.perf_counter() - t0
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t1 = time.perf_counter()
        learner.train(steps)
        profiled_s = time.perf_counter() - t1
    coll_s = _collective_seconds(prof) * train_s / max(profiled_s, 1e-9)
    t2 = time.perf_counter()
    learner.params()
    gather_s = time.perf_counter() - t2
    t3 = time.perf_counter()
    learner.outgoing(0, base, stats.tokens, stats.loss_last)
    delta_s = time.perf_counter() - t3  # gather + Δ + compress
    t4 = time.perf_counter()
    learner.load(base)
    load_s = time.perf_counter() - t4
    return {
        "tokens_per_s": stats.tokens / train_s,
        "step_s": train_s / steps,
        "collectives_per_step_s": coll_s / steps,
        "compute_per_step_s": max(0.0, train_s - coll_s) / steps,
        "gather_s": gather_s,
        "delta_extraction_s": delta_s,
        "load_version_s": load_s,
        "tokens_per_step": stats.tokens // steps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-tiny")
    ap.add_argument("--ranks", default="1,2", help="island sizes to measure, e.g. 1,2,4")
    ap.add_argument("--steps", type=int, default=6, help="inner steps timed per size")
    ap.add_argument("--batch-size", type=int, default=8, help="the run's step batch (rows)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--gpus", default="", help="CUDA devices for the ranks, e.g. 0,1,2,3")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="one device's peak")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cuda = a.device.startswith("cuda")
    gpus = [int(g) for g in a.gpus.split(",") if g.strip()] or [0]
    creator = Identity.generate()
    _, manifest, _ = create_manifest(
        creator,
        name="bench-island",
        model=a.model,
        data="embedded",
        seed=0,
        inner_steps=20,
        committee_size=1,
        genesis_committee=[creator.peer_id],
        inner={
            "batch_size": a.batch_size,
            "seq_len": a.seq_len,
            "warmup_steps": 2,
            "total_steps": 10_000,
        },
    )
    corpus = build_corpus(
        "embedded",
        load_tokenizer(get_spec(a.model).tokenizer),
        seq_len=a.seq_len,
        max_bytes=2**20,
    )
    from p2pdiloco.train.models import build_model, param_state

    base = {n: t.float().clone() for n, t in param_state(build_model(a.model, seed=0)).items()}
    n_params = parameter_count(a.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in [int(r) for r in a.ranks.split(",")]:
            if ranks == 1:
                device = torch.device(f"cuda:{gpus[0]}" if cuda else "cpu")
                learner: Learner = Learner(manifest, corpus, "bench", base, device=device)
            else:
                devices = (
                    tuple(f"cuda:{gpus[i]}" for i in range(ranks)) if cuda else ("cpu",) * ranks
                )
                spec = IslandSpec(devices, backend="nccl" if cuda else "gloo", threads=a.threads)
                learner = IslandLearner(
                    manifest, corpus, "bench", base, spec=spec, log_dir=Path(tmp)
                )
            try:
                row = {"ranks": ranks, **measure(learner, base, a.steps, cuda)}
            finally:
                learner.close()
            flops = 6 * n_params * row["tokens_per_s"]
            row["model_tflops"] = flops / 1e12
            row["mfu"] = flops / (ranks * a.peak_tflops * 1e12) if a.peak_tflops else None
            rows.append(row)
    result = {
        "model": a.model,
        "parameters": n_params,
        "device": a.device,
        "threads": a.threads,
        "batch": [a.batch_size, a.seq_len],
        "steps": a.steps,
        "rows": rows,
    }
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{a.model} ({n_params / 1e6:.1f} M parameters), step batch {a.batch_size} × "
        f"{a.seq_len}, {a.device}, {a.threads} thread(s) per rank"
    )
    print("ranks  tokens/s  step s  compute s  collectives s  gather s  delta s  load s  MFU")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(
            f"{r['ranks']:>5}  {r['tokens_per_s']:>8.0f}  {r['step_s']:>6.3f}  "
            f"{r['compute_per_step_s']:>9.3f}  {r['collectives_per_step_s']:>13.3f}  "
            f"{r['gather_s']:>8.3f}  {r['delta_extraction_s']:>7.3f}  {r['load_version_s']:>6.3f}"
            f"  {mfu}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
