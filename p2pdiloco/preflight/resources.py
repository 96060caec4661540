"""Preflight checks of memory and disk, from parameter counts on the meta device (no model
is allocated): does the model train on the device, is there room for its checkpoints."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from p2pdiloco.errors import UserError
from p2pdiloco.preflight.findings import Finding, PreflightConfig
from p2pdiloco.train.device import resolve_device
from p2pdiloco.train.island_plan import plan_island
from p2pdiloco.train.memory import (
    GiB,
    ModelTooLarge,
    available_memory,
    check_fits,
    estimate_memory,
    shares_host_memory,
)
from p2pdiloco.train.model_specs import get_spec, model_names, parameter_count

MAX_AUTO_BATCH = 64
# Disk headroom beyond the checkpoints themselves (logs, certificates, temp files).
DISK_SLACK = 1 * GiB
# fp32 states on disk at the peak: the two the certified store keeps, plus the one being written
# (its temp file exists until the rename, and the oldest is pruned only after that).
DISK_STATES = 3


def _precision_for(device: torch.device) -> str:
    # Same rule as ``join``: bf16 autocast with fp32 masters on CUDA and TPU, plain fp32 elsewhere.
    return "bf16-mixed" if device.type in ("cuda", "xla") else "fp32"


def auto_batch_size(model: str, device: torch.device | str, available_bytes: int) -> int:
    """Largest power of two ≤ 64 micro-batch sequences (at the model's default sequence
    length) whose training-memory estimate fits ``available_bytes``; 1 if none fits.

    Raises ModelError for an unknown model. The estimate is not a measurement: leave some
    memory out of ``available_bytes`` if other processes share the device.
    """
    dev = torch.device(device)
    precision, on_device = _precision_for(dev), shares_host_memory(dev)
    best = 1
    b = 1
    while b <= MAX_AUTO_BATCH:
        est = estimate_memory(model, precision, micro_batch=b, state_on_device=on_device)
        if est.total > available_bytes:
            break
        best = b
        b *= 2
    return best


def _resolve_available(cfg: PreflightConfig) -> tuple[torch.device, int, str] | Finding:
    """(device, bytes available, where that came from), or the finding saying why not."""
    try:
        dev = resolve_device(cfg.device)
    except UserError as e:
        return Finding(
            "device memory",
            "error",
            str(e),
            fix="pass --device auto (or cpu) or install the missing backend",
        )
    if cfg.gpus and dev.type != "cuda":
        return Finding(
            "device memory",
            "error",
            f"--gpus {','.join(map(str, cfg.gpus))} given but the device is {dev.type}",
            fix="drop --gpus, or pass --device cuda on a machine with usable NVIDIA GPUs",
        )
    indices: tuple[int, ...] = ()
    if dev.type == "cuda":
        indices = cfg.gpus or (dev.index if dev.index is not None else 0,)
        count = torch.cuda.device_count()
        if bad := [i for i in indices if not 0 <= i < count]:
            return Finding(
                "device memory",
                "error",
                f"GPU(s) {', '.join(map(str, bad))} not visible ({count} visible)",
                fix=f"choose --gpus among 0..{count - 1} (see nvidia-smi and CUDA_VISIBLE_DEVICES)",
            )
        dev = torch.device("cuda", indices[0])
    if cfg.max_memory_gb is not None:
        have = int(cfg.max_memory_gb * GiB)
        return dev, have, f"{dev.type} capped at {cfg.max_memory_gb:g} GiB by --max-memory"
    if dev.type == "cuda" and len(indices) > 1:
        probes = [(*available_memory(torch.device("cuda", i)), i) for i in indices]
        have, where, i = min(probes)
        return torch.device("cuda", i), have, f"GPU {i}: {where} (smallest of {len(indices)})"
    have, where = available_memory(dev)
    return dev, have, where


def check_device_memory(cfg: PreflightConfig) -> Finding:
    """Does ``cfg.model`` train on the chosen device at the chosen (or auto) batch?

    An error names the need against what is available, and the fix names the largest model
    that fits or the island size (devices of this kind) that would hold this one.
    """
    if cfg.model is None:
        return Finding(
            "device memory",
            "info",
            "no model chosen: memory not checked",
            fix="pass --model NAME (see `p2pdiloco models`)",
        )
    try:
        get_spec(cfg.model)
    except UserError as e:
        return Finding("device memory", "error", str(e), fix="see `p2pdiloco models`")
    resolved = _resolve_available(cfg)
    if isinstance(resolved, Finding):
        return resolved
    dev, have, where = resolved
    precision, on_device = _precision_for(dev), shares_host_memory(dev)
    auto = cfg.batch_size is None
    batch = auto_batch_size(cfg.model, dev, have) if cfg.batch_size is None else cfg.batch_size
    est = estimate_memory(cfg.model, precision, micro_batch=batch, state_on_device=on_device)
    # ``join`` uses the largest divisor of the run's batch per inner step up to this: say so,
    # so the plan here and the batch join prints agree.
    shape = (
        f"{precision}, auto batch up to {est.micro_batch}×{est.seq_len}; join takes at most the "
        "run's batch per inner step"
        if auto
        else f"{precision}, batch {est.micro_batch}×{est.seq_len}"
    )
    detail = f"{cfg.model} needs about {est.total / GiB:.1f} GiB ({shape}); {where}"
    try:
        check_fits(cfg.model, dev, precision, micro_batch=batch, available=have)
    except ModelTooLarge:
        return Finding(
            "device memory",
            "error",
            detail,
            fix=_too_large_fix(cfg.model, precision, on_device, have, auto),
        )
    return Finding("device memory", "ok", detail)


def _too_large_fix(model: str, precision: str, on_device: bool, have: int, auto: bool) -> str:
    if have <= 0:
        return "free some memory on the device (or raise --max-memory)"

    def need(name: str, micro_batch: int | None = None) -> int:
        est = estimate_memory(name, precision, micro_batch, state_on_device=on_device)
        return est.total

    plan = plan_island(model, precision, have)
    fitting = [n for n in model_names() if n != model and need(n) <= have]
    options = []
    if fitting:
        options.append(f"choose --model {fitting[-1]} (about {need(fitting[-1]) / GiB:.1f} GiB)")
    if not auto and need(model, 1) <= have:
        options.append("lower --batch-size (or leave it to auto)")
    if plan is not None:
        options.append(f"train {model} on {plan.describe()}")
    else:
        options.append(f"no island of such devices holds {model}: each needs more memory")
    return "; or ".join(options)


def fp32_state_bytes(model: str) -> int:
    """Bytes of one fp32 training state on disk: parameters plus the outer momentum."""
    return 2 * 4 * parameter_count(model)


def default_state_root() -> Path:
    """The XDG data dir that holds identities and run states (``~/.local/share/p2pdiloco``)."""
    from p2pdiloco.protocol.identity import default_identity_path

    return default_identity_path().parent


def check_disk(cfg: PreflightConfig) -> Finding:
    """Whether checkpoints can be written where they go: a file can be created there (in the
    nearest existing parent if the directory is not made yet), and the free space covers
    ``DISK_STATES`` fp32 states of the model plus 1 GiB. Error if not; warning below twice the
    space (other files will compete)."""
    path = cfg.state_dir if cfg.state_dir is not None else default_state_root()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    flag = "--state-dir" if cfg.state_dir is not None else "the default state directory"
    if (why := _unwritable(probe)) is not None:
        return Finding(
            "disk",
            "error",
            f"cannot write checkpoints under {path} ({flag}): {probe}: {why}",
            fix="pass --state-dir on a writable disk, or make that directory writable",
        )
    try:
        free = shutil.disk_usage(probe).free
    except OSError as e:
        return Finding(
            "disk",
            "error",
            f"cannot read free space at {probe}: {e}",
            fix="pass --state-dir on a readable, writable disk",
        )
    try:
        state = fp32_state_bytes(cfg.model) if cfg.model is not None else 0
    except UserError:
        state = 0  # unknown model: reported by the device memory check
    need = DISK_STATES * state + DISK_SLACK
    what = f"{DISK_STATES} checkpoints of {cfg.model} + 1 GiB" if state else "1 GiB"
    detail = f"{free / GiB:.1f} GiB free at {probe}; need {need / GiB:.1f} GiB ({what})"
    fix = f"free space there, or pass --state-dir on a disk with {need / GiB:.1f}+ GiB free"
    if free < need:
        return Finding("disk", "error", detail, fix=fix)
    if free < 2 * need:
        return Finding("disk", "warn", detail + "; little headroom", fix=fix)
    return Finding("disk", "ok", detail)


def _unwritable(directory: Path) -> str | None:
    """None if a file can be created (and removed) in ``directory``, else why not. A real write,
    not ``os.access``: root passes access checks on read-only mounts."""
    if not directory.is_dir():
        return "not a directory"
    try:
        fd, name = tempfile.mkstemp(prefix=".p2pdiloco-write-test-", dir=directory)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(name)
    return None
