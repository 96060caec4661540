"""Preflight: can this machine join a run? Each check returns findings, never raises.

A finding says what was found and, for a warning or an error, what to do about it. The checks
need no network except :func:`check_bootstrap`'s connects to the bootstrap servers, and never
allocate a model: memory and disk needs come from parameter counts on the meta device
(:mod:`p2pdiloco.train.memory`). Only programming errors raise (a bad argument type, an unknown
reachability status); everything wrong with the machine, the settings or the network is a
finding. ``p2pdiloco doctor`` prints them; ``join`` can run the same checks before it starts.

Modules: ``findings`` (the Finding and the settings checked), ``machine`` (Python, torch,
drivers), ``resources`` (device memory, disk), ``network`` (bootstrap addresses, reachability,
clock, protocol).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from p2pdiloco.preflight.findings import SEVERITIES, Finding, PreflightConfig, Severity, worst
from p2pdiloco.preflight.network import (
    CLOCK_ERROR_S,
    CLOCK_WARN_S,
    NTP_FIX,
    check_bootstrap,
    check_clock,
    check_protocol,
    check_reachability,
    parse_bootstrap,
)

if TYPE_CHECKING:
    from p2pdiloco.preflight.machine import MIN_PYTHON, MIN_TORCH, check_python, check_torch
    from p2pdiloco.preflight.resources import (
        DISK_SLACK,
        DISK_STATES,
        MAX_AUTO_BATCH,
        auto_batch_size,
        check_device_memory,
        check_disk,
        default_state_root,
        fp32_state_bytes,
    )

# Loaded on first use: ``machine`` and ``resources`` import torch, and ``join`` checks its
# bootstrap addresses (``parse_bootstrap``) before anything heavy, so a typo fails in a moment.
_LAZY = {
    **dict.fromkeys(("MIN_PYTHON", "MIN_TORCH", "check_python", "check_torch"), "machine"),
    **dict.fromkeys(
        (
            "DISK_SLACK",
            "DISK_STATES",
            "MAX_AUTO_BATCH",
            "auto_batch_size",
            "check_device_memory",
            "check_disk",
            "default_state_root",
            "fp32_state_bytes",
        ),
        "resources",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "CLOCK_ERROR_S",
    "CLOCK_WARN_S",
    "DISK_SLACK",
    "DISK_STATES",
    "MAX_AUTO_BATCH",
    "MIN_PYTHON",
    "MIN_TORCH",
    "NTP_FIX",
    "SEVERITIES",
    "Finding",
    "PreflightConfig",
    "Severity",
    "auto_batch_size",
    "check_bootstrap",
    "check_clock",
    "check_device_memory",
    "check_disk",
    "check_protocol",
    "check_python",
    "check_reachability",
    "check_torch",
    "default_state_root",
    "fp32_state_bytes",
    "parse_bootstrap",
    "run_preflight",
    "worst",
]


class _HasStatus(Protocol):
    """What :func:`run_preflight` reads from a ``net.reachability.Reachability``."""

    @property
    def status(self) -> str: ...
    @property
    def fix(self) -> str: ...


def run_preflight(
    cfg: PreflightConfig,
    *,
    clock_offset: float | None = None,
    reachability: str | _HasStatus | None = None,
    manifest_protocol: int | None = None,
) -> list[Finding]:
    """Every check in order: machine, memory, disk, bootstrap, then what the network measured.

    ``reachability`` is a status string or a ``net.reachability.Reachability`` (its fix is
    used). The measurements default to None, reported as info ("not measured").
    """
    from p2pdiloco.preflight.machine import check_python, check_torch
    from p2pdiloco.preflight.resources import check_device_memory, check_disk

    if isinstance(reachability, str) or reachability is None:
        status, fix = reachability, ""
    else:
        status, fix = reachability.status, reachability.fix
    return [
        check_python(),
        *check_torch(),
        check_device_memory(cfg),
        check_disk(cfg),
        *check_bootstrap(cfg),
        check_reachability(status, fix),
        check_clock(clock_offset),
        check_protocol(manifest_protocol),
    ]
