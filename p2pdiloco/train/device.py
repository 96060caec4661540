"""Device choice: ``auto`` picks cuda, then TPU (torch_xla), then mps, then cpu."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import torch

from p2pdiloco.errors import UserError


class DeviceError(UserError):
    """The requested device is not available here (one-line message)."""


def resolve_device(spec: str = "auto") -> torch.device:
    """Turn ``auto``/``cpu``/``cuda``/``cuda:N``/``mps``/``xla`` into a usable torch.device.

    Raises DeviceError naming what is missing when an explicit device is not available.
    """
    spec = spec.strip().lower()
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if importlib.util.find_spec("torch_xla") is not None:
            return _xla_device()
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(f"device '{spec}' requested but this torch has no usable CUDA")
        dev = torch.device(spec)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device '{spec}': only {torch.cuda.device_count()} GPU(s) visible")
        return dev
    if spec in ("xla", "tpu"):
        if importlib.util.find_spec("torch_xla") is None:
            raise DeviceError("device 'xla' requested but torch_xla is not installed")
        return _xla_device()
    if spec == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError("device 'mps' requested but no Apple GPU is available")
        return torch.device("mps")
    if spec == "cpu":
        return torch.device("cpu")
    raise DeviceError(f"unknown device '{spec}' (use auto, cpu, cuda, cuda:N, mps or xla)")


def _xla_device() -> torch.device:
    import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

    return torch.device(xm.xla_device())


@contextlib.contextmanager
def autocast_for(device: torch.device) -> Iterator[None]:
    """bf16 autocast on CUDA and TPU (fp32 master weights); plain fp32 elsewhere."""
    if device.type in ("cuda", "xla"):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    else:
        yield


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
