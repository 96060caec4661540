"""What a preflight check returns: a :class:`Finding`, and the settings it checks
(:class:`PreflightConfig`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

Severity = Literal["ok", "info", "warn", "error"]
SEVERITIES: tuple[Severity, ...] = ("ok", "info", "warn", "error")


@dataclass(frozen=True)
class Finding:
    """One result of one check. Raises ValueError if a warning or error comes without a fix."""

    check: str  # "python", "torch", "driver", "device memory", "disk", "bootstrap", ...
    severity: Severity
    detail: str  # what was found, one line
    fix: str = ""  # what to do about it (required for warn/error)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}")
        if self.severity in ("warn", "error") and not self.fix:
            raise ValueError(f"a {self.severity} finding needs a fix: {self.check}: {self.detail}")

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class PreflightConfig:
    """What the node would run with; the CLI maps its flags straight onto these fields."""

    # Model to check memory and disk for; None skips those checks (info).
    model: str | None = None
    # auto, cpu, cuda[:N], mps or xla, as for ``join``.
    device: str = "auto"
    # Restrict to these CUDA indices; the smallest free memory among them is what counts.
    gpus: tuple[int, ...] = ()
    # Cap on the memory the node may use (GiB); replaces the probe as the available amount.
    max_memory_gb: float | None = None
    # Micro-batch sequences; None = auto (:func:`auto_batch_size`).
    batch_size: int | None = None
    # Where checkpoints go (disk check); None = the XDG data dir.
    state_dir: Path | None = None
    # Bootstrap multiaddrs, already resolved from flags > env > config file.
    bootstrap: tuple[str, ...] = ()
    # Seconds per bootstrap TCP connect.
    timeout: float = 3.0

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {self.batch_size}")
        if self.max_memory_gb is not None and self.max_memory_gb <= 0:
            raise ValueError(f"max_memory_gb must be positive, not {self.max_memory_gb}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, not {self.timeout}")


def worst(findings: Iterable[Finding]) -> Severity:
    """The most severe severity among ``findings`` ("ok" when there are none)."""
    return max((f.severity for f in findings), key=SEVERITIES.index, default="ok")
