"""What an island is made of, decided from ``join``'s flags before anything starts (no torch
import: ``join --help`` stays fast), and whether the run's model trains on it."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from p2pdiloco.errors import ConfigError

GiB = 2**30


@dataclass(frozen=True)
class IslandSpec:
    """One device per rank (rank 0's first, in this process) and the collectives' backend."""

    devices: tuple[str, ...]  # "cpu", "cuda:1", ...
    backend: str = "gloo"  # gloo (CPU) or nccl (CUDA)
    timeout_s: float = 120.0  # a collective that waits longer fails (a hung member)
    threads: int | None = None  # torch threads per member
    # A LAN island: rank 0's store listens on ``host`` (all interfaces: 0.0.0.0) and other
    # hosts' ``join --lan-island`` become members as they come (their devices are their own).
    lan: bool = False
    host: str = "127.0.0.1"
    checkpointing: bool = False  # activation checkpointing per decoder layer (the plan's)
    offload: bool = False  # parameters, gradients and moments in host memory (CUDA only)
    # Seals the island's store (``island.sealed``); None: a fresh one. A LAN island's other
    # hosts pass the same (``join --island-secret``).
    secret: bytes | None = field(default=None, repr=False)

    @property
    def ranks(self) -> int:
        return len(self.devices)


def island_spec(
    device: str,
    gpus: tuple[int, ...],
    ranks: int | None,
    threads: int | None = None,
    *,
    lan: bool = False,
    host: str = "127.0.0.1",
    offload: bool = False,
) -> IslandSpec | None:
    """The island ``join`` forms: one rank per GPU of ``--gpus`` (NCCL), or ``--island-ranks``
    gloo processes on CPU, plus with ``lan`` the members other hosts bring; None for one process.
    ``offload`` (CUDA islands only) keeps weights, gradients and moments in host memory.
    ConfigError for a combination that cannot be."""
    devices = _rank_devices(device, gpus, ranks, lan)
    nccl = devices is not None and devices[0].startswith("cuda")
    if offload and not nccl:
        raise ConfigError("--offload moves an island's state off its GPUs: it needs --gpus 0,1,...")
    if devices is None:
        return None
    backend = "nccl" if nccl else "gloo"
    return IslandSpec(devices, backend, threads=threads, lan=lan, host=host, offload=offload)


def _rank_devices(
    device: str, gpus: tuple[int, ...], ranks: int | None, lan: bool
) -> tuple[str, ...] | None:
    """This host's device per rank (rank 0's first); None for one process."""
    if ranks is not None and ranks < 1:
        raise ConfigError(f"--island-ranks must be at least 1, not {ranks}")
    if len(gpus) > 1:
        if ranks not in (None, len(gpus)):
            raise ConfigError(
                f"--island-ranks {ranks} with {len(gpus)} --gpus: an island has one rank per GPU"
            )
        return tuple(f"cuda:{g}" for g in gpus)
    if (ranks is None or ranks == 1) and not lan:
        return None
    cuda = device.startswith("cuda") or bool(gpus)
    if cuda and (not lan or (ranks or 1) > 1):
        raise ConfigError("an island on CUDA takes --gpus 0,1,... (one rank per GPU)")
    if device not in ("cpu", "auto") and not cuda:
        raise ConfigError(f"an island of several ranks runs on CUDA or CPU, not {device}")
    if cuda:  # a LAN island's rank 0 on this host's one GPU
        return (f"cuda:{gpus[0]}" if gpus else device,)
    return ("cpu",) * (ranks or 1)


def check_island_fits(
    model: str, spec: IslandSpec, device_bytes: int, host_bytes: int | None = None
) -> tuple[str, bool]:
    """The plan line, and whether the plan checkpoints activations, if ``model`` trains on
    ``spec`` with ``device_bytes`` per rank (FSDP over all ranks); ModelTooLarge naming the
    island it would need otherwise, or the host memory rank 0 lacks for the DiLoCo state
    (``host_bytes``: what rank 0's host has free; None: not checked). On a gloo island the
    ranks' memory is the host's: each rank's ``device_bytes`` gives up its part of that state."""
    from p2pdiloco.train.island_plan import plan_island, rank0_host_bytes
    from p2pdiloco.train.memory import ModelTooLarge

    precision = "bf16-mixed" if spec.backend == "nccl" else "fp32"
    per = f"{device_bytes / GiB:.1f} GiB"
    usable = device_bytes
    if spec.backend == "gloo":
        usable -= -(-rank0_host_bytes(model) // spec.ranks)
        host_bytes = None
    plan = plan_island(model, precision, usable)
    if plan is None:
        raise ModelTooLarge(f"{model} does not train on devices of {per}, at any island size")
    if plan.devices > spec.ranks:
        raise ModelTooLarge(
            f"{model} needs an island of {plan.devices} devices of {per} "
            f"({plan.devices - spec.ranks} more than the {spec.ranks} ranks here)"
        )
    if host_bytes is not None and plan.host > host_bytes:
        raise ModelTooLarge(
            f"{model}'s island needs about {plan.host / GiB:.0f} GiB of host memory on rank 0 "
            f"(the DiLoCo state), but this host has {host_bytes / GiB:.1f} GiB available"
        )
    return f"{spec.ranks} ranks; {model} needs {plan.describe()}", plan.checkpointing


def default_gpus() -> tuple[int, ...]:
    """Every CUDA device visible to this process when there are several (``join`` then forms
    one island of them); () with one GPU or none, where one process trains as before."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return tuple(range(count)) if count > 1 else ()


def lan_host(host: str) -> str:
    """The address other hosts of the LAN reach this one at: ``host``, or for 0.0.0.0 the
    address of the interface with the default route (no packet is sent)."""
    if host not in ("0.0.0.0", "", "::"):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks a route
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"
