"""Island MFU on one GPU, and the per-layer memory that the island plan predicts (issue 13).

One process, one rank. Each cell trains inner steps of the run's loop (``train_steps``: AdamW,
fp32 master weights, bf16 autocast on CUDA, clipping, accumulation) on random tokens, either

- ``plain``: the model on the device as one learner holds it (``Learner``: one GPU, no island),
- ``fsdp``: the island's own ``Shards`` (``fully_shard`` per decoder layer and the root,
  activation checkpointing when asked) on a 1-rank process group of the island's backend
  (NCCL on CUDA): every FSDP2 all-gather and reduce-scatter runs, over one rank.

A reduced layer count at the model's real width (``--layers 2,6``: ``gemma-12b@L2``, ...) shows
the memory per decoder layer: the peak at two layer counts, the difference over the layers,
beside what ``train.island_plan`` counts per layer at the same micro-batch, sequence length and
checkpointing. From the two points it extrapolates the full model's peak on one rank and, the
training state split over N ranks, what one rank of the plan's island would hold.

    python bench/gpu_island.py --model gemma-1b --mode plain --seq-len 2048 --micro-batch 4 \\
        --step-batch 16 --device cuda --peak-tflops 989 --out $OUT/g1b.json
    python bench/gpu_island.py --model gemma-12b --layers 2,6 --mode fsdp --checkpointing \\
        --seq-len 4096 --micro-batch 1 --step-batch 4 --device cuda --peak-tflops 989
    .venv/bin/python bench/gpu_island.py --model gemma-tiny --layers 2,4 --mode fsdp  # CPU

``bench/gpu_island.sh`` runs issue 13's cells (figures in docs/benchmarks.md); ``--profile``
adds the timed steps' GPU kernel time by kind (matmul, attention, loss, optimizer, other).

MFU = model FLOPs per second ÷ the device's peak; model FLOPs = 6 × parameters per token (the
dense count ``bench/island.py`` uses; recomputation under checkpointing is not counted), and
beside it the same with attention's score and value products (12 × q width × keys attended per
layer per token; Gemma 3: every 6th layer global and causal, the rest within the window).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from p2pdiloco.train import model_specs
from p2pdiloco.train.configs import InnerConfig
from p2pdiloco.train.inner import make_inner_optimizer, train_steps
from p2pdiloco.train.island_plan import _plan, plan_island
from p2pdiloco.train.model_specs import get_spec, parameter_count
from p2pdiloco.train.models import build_for_loading

GiB = 2**30


def layered(model: str, layers: int | None) -> str:
    """The registered name of ``model`` at ``layers`` decoder layers (its real width)."""
    spec = get_spec(model)
    if layers is None or layers == spec.num_layers:
        return model
    name = f"{model}@L{layers}"
    model_specs.REGISTRY.setdefault(name, dataclasses.replace(spec, name=name, num_layers=layers))
    return name


def attention_flops_per_token(name: str, seq: int) -> float:
    """Forward + backward FLOPs of attention's two products per token (causal, windowed)."""
    s = get_spec(name)
    q = s.num_heads * s.head_dim
    full = (seq + 1) / 2
    w = min(s.sliding_window, seq)
    windowed = (w * (w + 1) / 2 + (seq - w) * w) / seq  # mean keys per query
    total = 0.0
    for i in range(s.num_layers):
        keys = full if (i + 1) % 6 == 0 else windowed
        total += 12 * q * keys  # QK^T and PV, 2 q FLOPs per key each; × 3 fwd + bwd
    return total


@torch.no_grad()
def init_weights(model: torch.nn.Module) -> None:
    """Weights of a trained-from-scratch scale (the values do not change the step's time)."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if p.ndim >= 2:
            local.normal_(0.0, 0.02)
        else:
            local.zero_()


def probe_cpu_collective() -> str:
    """Whether this group reduces a CPU tensor (the island's finite flag did, before it moved
    onto the rank's device)."""
    try:
        t = torch.ones(1, dtype=torch.int32)
        dist.all_reduce(t)
        return "ok"
    except Exception as e:  # the backend's own error type
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"


KINDS = (  # kernel name fragments, first match wins
    ("collectives", ("nccl",)),
    ("attention", ("fmha", "flash", "attention", "efficient")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma")),
    ("optimizer", ("multi_tensor", "foreach", "adam")),
    ("loss", ("softmax", "cross_entropy", "nll")),
)


def profiler(cuda: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))


def kernel_split(prof: Any, wall_s: float) -> dict[str, Any]:
    """GPU kernel time of the timed steps by kind (seconds, and share of the wall), the GPU's
    busy share of the wall, and the ten longest kernels."""
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", 0):
            continue  # annotations (the optimizer's step, FSDP's) span kernels counted already
        us = float(e.time_range.elapsed_us())  # a kernel's own span on the GPU
        low = e.name.lower()
        kind = next((k for k, frags in KINDS if any(f in low for f in frags)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e6
        by_name[e.name[:120]] = by_name.get(e.name[:120], 0.0) + us / 1e6
    busy = sum(by_kind.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {
        "wall_s": wall_s,
        "gpu_busy_s": busy,
        "gpu_busy_share": busy / wall_s,
        "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top": [[n, t] for n, t in top],
    }


def build(name: str, a: argparse.Namespace, device: torch.device, cfg: InnerConfig) -> Any:
    """(model, optimizer, scheduler, grad_accum, train function) for one cell."""
    if a.mode == "plain":
        model = build_for_loading(name, device=device)
        if a.checkpointing:
            from p2pdiloco.island.shards import enable_checkpointing

            enable_checkpointing(model)
        init_weights(model)
        opt, sched = make_inner_optimizer(model, cfg)
        return model, partial(
            train_steps, model, opt, sched, grad_accum=cfg.grad_accum, grad_clip=cfg.grad_clip
        )
    from p2pdiloco.island.shards import Shards

    shards = Shards(
        name, 0, cfg, device=device, micro_batch=a.micro_batch, checkpointing=a.checkpointing
    )
    init_weights(shards.model)
    return shards.model, shards.train


def run_cell(name: str, a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    spec = get_spec(name)
    cfg = InnerConfig(
        batch_size=a.step_batch,
        seq_len=a.seq_len,
        warmup_steps=2,
        total_steps=10_000,
        grad_accum=a.step_batch // a.micro_batch,
    )
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(
        0, spec.vocab_size - 8, (a.warmup + a.steps, a.step_batch, a.seq_len + 1), generator=gen
    )
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t_build = time.perf_counter()
    model, train = build(name, a, device, cfg)
    build_s = time.perf_counter() - t_build
    try:
        if a.warmup:
            train(rows[: a.warmup])
        if cuda:
            torch.cuda.synchronize(device)
            rest = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        prof = profiler(cuda) if a.profile else contextlib.nullcontext()
        with prof:
            t0 = time.perf_counter()
            stats = train(rows[a.warmup :])
            if cuda:
                torch.cuda.synchronize(device)
            train_s = time.perf_counter() - t0
        kernels = kernel_split(prof, train_s) if a.profile else None
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        reserved = torch.cuda.max_memory_reserved(device) if cuda else None
    finally:
        del model, train
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    n_params = parameter_count(name)
    tps = stats.tokens / train_s
    dense = 6 * n_params * tps
    attn = attention_flops_per_token(name, a.seq_len) * tps
    peak_flops = a.peak_tflops * 1e12 if a.peak_tflops else None
    plan = _plan(name, "bf16-mixed", 2**60, a.micro_batch, a.seq_len, a.checkpointing)
    assert plan is not None and plan.devices == 1
    return {
        "model": name,
        "layers": spec.num_layers,
        "parameters": n_params,
        "mode": a.mode,
        "checkpointing": a.checkpointing,
        "seq_len": a.seq_len,
        "micro_batch": a.micro_batch,
        "step_batch": a.step_batch,
        "steps": a.steps,
        "build_s": round(build_s, 2),
        "step_s": train_s / a.steps,
        "tokens_per_s": tps,
        "loss_last": stats.loss_last,
        "model_tflops": dense / 1e12,
        "model_tflops_with_attention": (dense + attn) / 1e12,
        "mfu": dense / peak_flops if peak_flops else None,
        "mfu_with_attention": (dense + attn) / peak_flops if peak_flops else None,
        "rest_gib": rest / GiB if cuda else None,  # weights + AdamW moments between steps
        "peak_gib": peak / GiB if peak is not None else None,
        "reserved_gib": reserved / GiB if reserved is not None else None,
        "kernels": kernels,
        "plan_one_device_gib": plan.per_device / GiB,  # the plan's figure at N = 1, this shape
        "plan_state_gib": plan.shard / GiB,
        "plan_activations_gib": plan.activations / GiB,
        "plan_casts_gib": plan.casts / GiB,  # autocast's bf16 weight copies (not sharded)
    }


def per_layer(model: str, rows: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    """Measured GiB per decoder layer (two layer counts) beside the plan's, and the full
    model's island extrapolated from the measured line."""
    ok = sorted((r for r in rows if r.get("peak_gib") is not None), key=lambda r: r["layers"])
    if len(ok) < 2:
        return {}
    lo, hi = ok[0], ok[-1]
    dl = hi["layers"] - lo["layers"]
    meas = (hi["peak_gib"] - lo["peak_gib"]) / dl
    rest = (hi["rest_gib"] - lo["rest_gib"]) / dl
    plan = (hi["plan_one_device_gib"] - lo["plan_one_device_gib"]) / dl
    full = get_spec(model)
    layer_params = (hi["parameters"] - lo["parameters"]) / dl
    fixed = lo["peak_gib"] - lo["layers"] * meas  # what does not scale with layers
    one_rank = fixed + full.num_layers * meas
    out: dict[str, Any] = {
        "model": model,
        "layers": [r["layers"] for r in ok],
        "mode": a.mode,
        "checkpointing": a.checkpointing,
        "micro_batch": a.micro_batch,
        "seq_len": a.seq_len,
        "layer_parameters": layer_params,
        "measured_per_layer_gib": meas,
        "measured_state_per_layer_gib": rest,
        "plan_per_layer_gib": plan,  # with its allowance (ADR 0049: 30 %; 10 % before)
        # The plan's state: 16 B per parameter on the GPU (weights, gradients, AdamW); before
        # ADR 0049 it also counted the 8 B of DiLoCo base and error feedback kept on the host.
        "plan_state_per_layer_gib": (hi["plan_state_gib"] - lo["plan_state_gib"]) / dl,
        "plan_activations_per_layer_gib": (hi["plan_activations_gib"] - lo["plan_activations_gib"])
        / dl,
        "measured_fixed_gib": fixed,
        "full_model_one_rank_gib": one_rank,
    }
    if a.device_gib:
        isl = plan_island(model, "bf16-mixed", int(a.device_gib * GiB), a.micro_batch, a.seq_len)
        if isl is not None:
            # Sharded over N: weights, gradients and moments (16 B per parameter, measured
            # as 12 B at rest + the gradient); activations, logits and gathered units are not.
            state_total = 16 * parameter_count(model) / GiB
            out["plan_island"] = {
                "device_gib": a.device_gib,
                "devices": isl.devices,
                "checkpointing": isl.checkpointing,
                "micro_batch": isl.micro_batch,
                "plan_per_device_gib": isl.per_device / GiB,
                "measured_per_device_gib": one_rank - state_total + state_total / isl.devices,
            }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-tiny")
    ap.add_argument("--layers", default="", help="decoder layer counts at real width, e.g. 2,6")
    ap.add_argument("--mode", choices=("plain", "fsdp"), default="plain")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--step-batch", type=int, default=4, help="rows per inner step")
    ap.add_argument("--steps", type=int, default=3, help="timed inner steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="", help="island group backend (nccl on CUDA)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="one device's bf16 peak")
    ap.add_argument("--device-gib", type=float, default=None, help="plan an island of these")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="GPU kernel time by kind")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:
        device = torch.device("cuda", 0)
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        if a.device_gib is None:
            a.device_gib = torch.cuda.get_device_properties(device).total_memory / GiB
    result: dict[str, Any] = {
        "argv": sys.argv[1:],
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "rows": [],
        "errors": [],
    }
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    tmp = tempfile.mkdtemp()
    if a.mode == "fsdp":
        backend = a.backend or ("nccl" if cuda else "gloo")
        dist.init_process_group(
            backend,
            store=dist.FileStore(os.path.join(tmp, "pg"), 1),
            rank=0,
            world_size=1,
            device_id=device if backend == "nccl" else None,
        )
        result["backend"] = backend
        result["cpu_tensor_collective"] = probe_cpu_collective()
        print(f"group {backend}: a CPU tensor's all-reduce: {result['cpu_tensor_collective']}")
    counts: list[int | None] = [int(x) for x in a.layers.split(",") if x.strip()] or [None]
    for n in counts:
        name = layered(a.model, n)
        try:
            row = run_cell(name, a, device)
        except Exception as e:  # an OOM or a backend error: keep the other cells
            msg = f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            print("FAILED", msg, file=sys.stderr)
            traceback.print_exc()
            result["errors"].append(msg)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            continue
        result["rows"].append(row)
        print(json.dumps(row))
    result["per_layer"] = per_layer(a.model, result["rows"], a)
    if result["per_layer"]:
        print(json.dumps(result["per_layer"]))
    if a.mode == "fsdp":
        dist.destroy_process_group()
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return 0 if result["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
