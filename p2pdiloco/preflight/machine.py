"""Preflight checks of the machine: Python, torch, and what torch can train on."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import torch
from torch.torch_version import TorchVersion

from p2pdiloco.preflight.findings import Finding

MIN_PYTHON = (3, 11)
MIN_TORCH = "2.4"


def check_python() -> Finding:
    v = sys.version_info
    detail = f"Python {v.major}.{v.minor}.{v.micro} ({sys.implementation.name})"
    if (v.major, v.minor) >= MIN_PYTHON:
        return Finding("python", "ok", detail)
    need = ".".join(map(str, MIN_PYTHON))
    return Finding(
        "python",
        "error",
        f"{detail}; p2pdiloco needs {need}+",
        fix=f"install Python {need} or newer and reinstall p2pdiloco in it",
    )


def check_torch() -> list[Finding]:
    """torch's version, then what it can train on: GPUs with driver/runtime versions, or CPU.

    A CUDA machine whose torch cannot use its GPU (CPU-only build, driver too old) is a
    warning, since the node would silently train on the CPU.
    """
    version = TorchVersion(torch.__version__)
    if version >= MIN_TORCH:
        findings = [Finding("torch", "ok", f"torch {version}")]
    else:
        findings = [
            Finding(
                "torch",
                "error",
                f"torch {version}; p2pdiloco needs {MIN_TORCH}+",
                fix=f"pip install -U 'torch>={MIN_TORCH}'",
            )
        ]
    findings.append(_driver_finding())
    return findings


def _driver_finding() -> Finding:
    cuda_build = torch.version.cuda
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names = ", ".join(f"{i}: {torch.cuda.get_device_name(i)}" for i in range(n))
        if torch.version.hip:
            stack = f"ROCm {torch.version.hip}"
        else:
            stack = f"CUDA driver {_cuda_driver_version()}, runtime {cuda_build}"
        return Finding("driver", "ok", f"{stack}; {n} GPU(s): {names}")
    nvidia_present = shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()
    if nvidia_present and cuda_build:
        return Finding(
            "driver",
            "warn",
            f"an NVIDIA GPU is present but torch (built for CUDA {cuda_build}) cannot use it",
            fix=f"update the NVIDIA driver to one for CUDA {cuda_build} or newer (nvidia-smi "
            "shows the driver's CUDA version), or install a torch build matching the driver",
        )
    if nvidia_present:
        return Finding(
            "driver",
            "warn",
            f"an NVIDIA GPU is present but torch {torch.__version__} is a CPU-only build",
            fix="install a CUDA build of torch (https://pytorch.org/get-started/locally/)",
        )
    if importlib.util.find_spec("torch_xla") is not None:
        return Finding("driver", "ok", "TPU through torch_xla")
    if torch.backends.mps.is_available():
        return Finding("driver", "ok", "Apple GPU (MPS)")
    return Finding(
        "driver",
        "info",
        "no GPU: CPU only; small models only",
        fix="gemma-tiny and gemma-small train on a CPU; see `p2pdiloco models`",
    )


def _cuda_driver_version() -> str:
    get = getattr(torch._C, "_cuda_getDriverVersion", None)  # private, but needs no pynvml
    try:
        v = int(get()) if get is not None else 0  # e.g. 12040 for 12.4
    except RuntimeError:
        v = 0
    if v <= 0:
        return "unknown"
    return f"{v // 1000}.{v % 1000 // 10}"
