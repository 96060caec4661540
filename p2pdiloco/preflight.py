"""Preflight: can this machine join a run? Each check returns findings, never raises.

A finding says what was found and, for a warning or an error, what to do about it. The checks
need no network except :func:`check_bootstrap`'s plain TCP connects, and never allocate a
model: memory and disk needs come from parameter counts on the meta device
(:mod:`p2pdiloco.train.memory`). Only programming errors raise (a bad argument type, an unknown
reachability status); everything wrong with the machine, the settings or the network is a
finding. ``p2pdiloco doctor`` prints them; ``join`` can run the same checks before it starts.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import math
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
from torch.torch_version import TorchVersion

from p2pdiloco.errors import UserError
from p2pdiloco.protocol.signing import PROTOCOL_VERSION
from p2pdiloco.train.device import resolve_device
from p2pdiloco.train.memory import (
    GiB,
    ModelTooLarge,
    available_memory,
    check_fits,
    estimate_memory,
)
from p2pdiloco.train.models import get_spec, model_names, parameter_count

Severity = Literal["ok", "info", "warn", "error"]
SEVERITIES: tuple[Severity, ...] = ("ok", "info", "warn", "error")

MIN_PYTHON = (3, 11)
MIN_TORCH = "2.4"
MAX_AUTO_BATCH = 64
# Clock offsets (seconds) past which signed records with TTLs start to be judged wrongly.
CLOCK_WARN_S = 5.0
CLOCK_ERROR_S = 60.0
# Disk headroom beyond the checkpoints themselves (logs, certificates, temp files).
DISK_SLACK = 1 * GiB
NTP_FIX = "enable NTP time sync: `sudo timedatectl set-ntp true` (or your OS's equivalent)"
_BASE58 = set("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")
_ADDR_FAMILY = {
    "ip4": socket.AF_INET,
    "ip6": socket.AF_INET6,
    "dns4": socket.AF_INET,
    "dns6": socket.AF_INET6,
    "dns": socket.AF_UNSPEC,
}


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


class _HasStatus(Protocol):
    """What :func:`run_preflight` reads from a ``net.reachability.Reachability``."""

    @property
    def status(self) -> str: ...
    @property
    def fix(self) -> str: ...


def worst(findings: Iterable[Finding]) -> Severity:
    """The most severe severity among ``findings`` ("ok" when there are none)."""
    return max((f.severity for f in findings), key=SEVERITIES.index, default="ok")


# ---------------------------------------------------------------------------------------------
# the machine


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


# ---------------------------------------------------------------------------------------------
# memory and disk


def _precision_for(device: torch.device) -> str:
    # Same rule as ``join``: bf16 autocast with fp32 masters on CUDA and TPU, plain fp32 elsewhere.
    return "bf16-mixed" if device.type in ("cuda", "xla") else "fp32"


def auto_batch_size(model: str, device: torch.device | str, available_bytes: int) -> int:
    """Largest power of two ≤ 64 micro-batch sequences (at the model's default sequence
    length) whose training-memory estimate fits ``available_bytes``; 1 if none fits.

    Raises ModelError for an unknown model. The estimate is not a measurement: leave some
    memory out of ``available_bytes`` if other processes share the device.
    """
    precision = _precision_for(torch.device(device))
    best = 1
    b = 1
    while b <= MAX_AUTO_BATCH:
        if estimate_memory(model, precision, micro_batch=b).total > available_bytes:
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
    precision = _precision_for(dev)
    auto = cfg.batch_size is None
    batch = auto_batch_size(cfg.model, dev, have) if cfg.batch_size is None else cfg.batch_size
    est = estimate_memory(cfg.model, precision, micro_batch=batch)
    shape = f"{precision}, {'auto ' if auto else ''}batch {est.micro_batch}×{est.seq_len}"
    detail = f"{cfg.model} needs about {est.total / GiB:.1f} GiB ({shape}); {where}"
    try:
        check_fits(cfg.model, dev, precision, micro_batch=batch, available=have)
    except ModelTooLarge:
        return Finding(
            "device memory",
            "error",
            detail,
            fix=_too_large_fix(cfg.model, precision, est.total, have, auto),
        )
    return Finding("device memory", "ok", detail)


def _too_large_fix(model: str, precision: str, need: int, have: int, auto: bool) -> str:
    if have <= 0:
        return "free some memory on the device (or raise --max-memory)"
    island = math.ceil(need / have)
    fitting = [
        n for n in model_names() if n != model and estimate_memory(n, precision).total <= have
    ]
    options = []
    if fitting:
        options.append(
            f"choose --model {fitting[-1]} "
            f"(about {estimate_memory(fitting[-1], precision).total / GiB:.1f} GiB)"
        )
    if not auto and estimate_memory(model, precision, micro_batch=1).total <= have:
        options.append("lower --batch-size (or leave it to auto)")
    options.append(f"train {model} on an island of {island} such devices")
    return "; or ".join(options)


def fp32_state_bytes(model: str) -> int:
    """Bytes of one fp32 training state on disk: parameters plus the outer momentum."""
    return 2 * 4 * parameter_count(model)


def default_state_root() -> Path:
    """The XDG data dir that holds identities and run states (``~/.local/share/p2pdiloco``)."""
    from p2pdiloco.protocol.identity import default_identity_path

    return default_identity_path().parent


def check_disk(cfg: PreflightConfig) -> Finding:
    """Free space where checkpoints go against two fp32 states (the certified store keeps two)
    plus 1 GiB. Error below that; warning below twice that (other files will compete)."""
    path = cfg.state_dir if cfg.state_dir is not None else default_state_root()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
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
    need = 2 * state + DISK_SLACK
    what = f"2 checkpoints of {cfg.model} + 1 GiB" if state else "1 GiB"
    detail = f"{free / GiB:.1f} GiB free at {probe}; need {need / GiB:.1f} GiB ({what})"
    fix = f"free space there, or pass --state-dir on a disk with {need / GiB:.1f}+ GiB free"
    if free < need:
        return Finding("disk", "error", detail, fix=fix)
    if free < 2 * need:
        return Finding("disk", "warn", detail + "; little headroom", fix=fix)
    return Finding("disk", "ok", detail)


# ---------------------------------------------------------------------------------------------
# the network


@dataclass(frozen=True)
class _Target:
    address: str
    host: str
    port: int
    family: int


def parse_bootstrap(address: str) -> _Target | str:
    """``/ip4|ip6|dns4|dns6|dns/HOST/tcp/PORT/p2p/ID`` → target, or why it is malformed."""
    parts = address.strip().split("/")
    if len(parts) != 7 or parts[0] != "":
        return "expected /ip4/HOST/tcp/PORT/p2p/PEER_ID"
    _, proto, host, tcp, port_s, p2p, peer = parts
    if proto not in _ADDR_FAMILY:
        return f"'{proto}' is not one of ip4, ip6, dns4, dns6"
    if proto in ("ip4", "ip6"):
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return f"'{host}' is not an {proto} address"
        if ip.version != int(proto[-1]):
            return f"'{host}' is not an {proto} address"
    elif not host:
        return "empty host name"
    if tcp != "tcp":
        return f"expected 'tcp' after the host, not '{tcp}'"
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        return f"'{port_s}' is not a TCP port"
    if p2p != "p2p" or not peer or not set(peer) <= _BASE58:
        return "expected /p2p/PEER_ID (base58) at the end"
    return _Target(address, host, int(port_s), _ADDR_FAMILY[proto])


def _tcp_connect(target: _Target, timeout: float) -> str | None:
    """None if a TCP connection opened (and was closed at once), else why not."""
    try:
        infos = socket.getaddrinfo(target.host, target.port, target.family, socket.SOCK_STREAM)
    except OSError:
        return f"cannot resolve {target.host}"
    reason = "no address"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout)
            try:
                s.connect(sockaddr)
            except ConnectionRefusedError:
                reason = "connection refused"
            except TimeoutError:
                reason = f"no answer within {timeout:g} s"
            except OSError as e:
                reason = e.strerror or str(e)
            else:
                return None
    return reason


def check_bootstrap(cfg: PreflightConfig) -> list[Finding]:
    """One finding per bootstrap address: a plain TCP connect (no libp2p handshake) within
    ``cfg.timeout``, all addresses at once. An unreachable address is an error when none is
    reachable, else a warning; a malformed one is always an error. Name resolution for dns
    addresses is bounded only by the overall deadline (2 × timeout + 1 s)."""
    if not cfg.bootstrap:
        from p2pdiloco.config import config_path

        return [
            Finding(
                "bootstrap",
                "error",
                "no bootstrap server configured",
                fix="pass --bootstrap /ip4/HOST/tcp/PORT/p2p/PEER_ID, set P2PDILOCO_BOOTSTRAP, "
                f'or add bootstrap = ["..."] to {config_path()}',
            )
        ]
    malformed: list[Finding] = []
    targets: list[_Target] = []
    for addr in cfg.bootstrap:
        parsed = parse_bootstrap(addr)
        if isinstance(parsed, str):
            malformed.append(
                Finding(
                    "bootstrap",
                    "error",
                    f"malformed address '{addr}': {parsed}",
                    fix="copy the full multiaddr the bootstrap server prints at start",
                )
            )
        else:
            targets.append(parsed)
    results = _connect_all(targets, cfg.timeout)
    any_ok = any(reason is None for reason, _ in results)
    found = []
    for t, (reason, seconds) in zip(targets, results, strict=True):
        where = f"{t.host}:{t.port}"
        if reason is None:
            found.append(Finding("bootstrap", "ok", f"{where} reachable ({seconds * 1e3:.0f} ms)"))
        else:
            found.append(
                Finding(
                    "bootstrap",
                    "warn" if any_ok else "error",
                    f"{where} unreachable: {reason}",
                    fix=f"check the address and that the server is up; allow outgoing TCP to "
                    f"port {t.port} in your firewall; or pass --bootstrap with another server",
                )
            )
    return found + malformed


def _connect_all(targets: list[_Target], timeout: float) -> list[tuple[str | None, float]]:
    # Daemon threads: a name lookup stuck past the deadline must not hold the process open.
    results: list[tuple[str | None, float]] = [("no answer (name lookup hung?)", 0.0)] * len(
        targets
    )

    def probe(i: int) -> None:
        t0 = time.monotonic()
        reason = _tcp_connect(targets[i], timeout)
        results[i] = (reason, time.monotonic() - t0)

    threads = [threading.Thread(target=probe, args=(i,), daemon=True) for i in range(len(targets))]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 2 * timeout + 1
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    return list(results)


def check_reachability(status: str | None, fix: str = "") -> Finding:
    """Raises ValueError for a status other than direct, relayed, unknown or None."""
    if status == "direct":
        return Finding("reachability", "ok", "peers can dial this node directly")
    if status == "relayed":
        return Finding(
            "reachability",
            "warn",
            "peers reach this node only through a relay (slower state transfers)",
            fix=fix or "open or forward the node's TCP ports (--port and --port+1) to this host",
        )
    if status in ("unknown", None):
        return Finding("reachability", "info", "not measured (needs a reachable bootstrap server)")
    raise ValueError(f"unknown reachability status {status!r}")


def check_clock(offset_seconds: float | None) -> Finding:
    """The clock against peers': heartbeats and records expire on wall-clock time."""
    if offset_seconds is None:
        return Finding("clock", "info", "offset from peers not measured")
    detail = f"clock is {offset_seconds:+.1f} s off the network's"
    if abs(offset_seconds) < CLOCK_WARN_S:
        return Finding("clock", "ok", detail)
    if abs(offset_seconds) < CLOCK_ERROR_S:
        return Finding("clock", "warn", detail, fix=NTP_FIX)
    return Finding("clock", "error", detail + "; peers will reject its records", fix=NTP_FIX)


def check_protocol(manifest_protocol: int | None) -> Finding:
    if manifest_protocol is None:
        return Finding("protocol", "info", f"speaks protocol {PROTOCOL_VERSION}; run not checked")
    if manifest_protocol == PROTOCOL_VERSION:
        return Finding("protocol", "ok", f"run and this node speak protocol {PROTOCOL_VERSION}")
    detail = f"run speaks protocol {manifest_protocol}, this p2pdiloco {PROTOCOL_VERSION}"
    if manifest_protocol > PROTOCOL_VERSION:
        fix = "upgrade: pip install -U p2pdiloco"
    else:
        fix = (
            f"join a run on protocol {PROTOCOL_VERSION}, or install a p2pdiloco release that "
            f"speaks protocol {manifest_protocol}"
        )
    return Finding("protocol", "error", detail, fix=fix)


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
