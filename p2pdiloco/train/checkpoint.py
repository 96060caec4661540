"""Crash-safe, verifiable checkpoints: one ``.safetensors`` file per checkpoint.

A checkpoint is written to a temp file in the target directory, fsynced, and
``os.replace``-d onto the target, so a reader sees either the old complete file
or the new complete file, never a partial one. Every checkpoint records its
canonical :func:`state_hash`, which loading recomputes; the same hash is what a
quorum certificate signs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from p2pdiloco.errors import UserError

__all__ = [
    "STATE_HASH_DOMAIN",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "load_checkpoint",
    "read_checkpoint_meta",
    "save_checkpoint",
    "state_hash",
]

log = logging.getLogger(__name__)

STATE_HASH_DOMAIN = b"p2pdiloco/state-hash/v1"
FORMAT_VERSION = 1
META_KEY = "p2pdiloco"

# Bounds the extra memory of hashing accelerator tensors, which are copied to CPU in pieces.
_HASH_CHUNK_BYTES = 64 << 20

# Test hook: called with the temp path once it is fully written and fsynced, before the rename.
_after_temp_written: Callable[[Path], None] | None = None


class CheckpointError(UserError):
    """A checkpoint is missing, unreadable, corrupt or fails verification (one-line message)."""


@dataclass
class Checkpoint:
    """A loaded checkpoint; ``meta`` includes the ``state_hash`` and ``format`` keys as stored."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    state_hash: str


def _i64(value: int) -> bytes:
    return struct.pack("<q", value)


def _update_with_tensor_bytes(h: Any, tensor: torch.Tensor) -> None:
    flat = tensor.detach().contiguous().reshape(-1)
    esize = flat.element_size()
    step = max(1, _HASH_CHUNK_BYTES // esize)
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step].cpu().view(torch.uint8)
        if sys.byteorder != "little":
            piece = piece.view(-1, esize).flip(1).contiguous().view(-1)
        h.update(piece.numpy())


def state_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """Canonical sha256 hex digest of named tensors, independent of order and device.

    Layout (all integers int64 little-endian): ``STATE_HASH_DOMAIN``, then for
    each name in sorted order: ``len(name_utf8)``, ``name_utf8``, ``len(dtype)``,
    ``dtype`` (e.g. ``b"float32"``), ``ndim``, each dim, ``nbytes``, and the raw
    little-endian element bytes in C order.

    Raises TypeError for non-str names or non-tensor values and ValueError for
    non-strided (sparse, etc.) tensors.
    """
    h = hashlib.sha256()
    h.update(STATE_HASH_DOMAIN)
    for name in sorted(tensors):
        tensor = tensors[name]
        if not isinstance(name, str):
            raise TypeError(f"tensor name must be str, got {type(name).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.layout != torch.strided:
            raise ValueError(f"{name!r} has unsupported layout {tensor.layout}")
        name_bytes = name.encode("utf-8")
        dtype_bytes = str(tensor.dtype).removeprefix("torch.").encode("ascii")
        h.update(_i64(len(name_bytes)) + name_bytes)
        h.update(_i64(len(dtype_bytes)) + dtype_bytes)
        h.update(_i64(tensor.dim()) + b"".join(_i64(d) for d in tensor.shape))
        h.update(_i64(tensor.numel() * tensor.element_size()))
        _update_with_tensor_bytes(h, tensor)
    return h.hexdigest()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; some platforms cannot open directories, which is fine.
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(path: Path) -> None:
    """Remove ``.<name>.tmp-<pid>-*`` left by dead writers; temps of live processes are kept."""
    pattern = re.compile(re.escape(f".{path.name}.tmp-") + r"(\d+)-")
    for candidate in path.parent.glob(f".{path.name}.tmp-*"):
        match = pattern.match(candidate.name)
        if match:
            pid = int(match.group(1))
            # Our own pid means another thread of this process is mid-write.
            if pid == os.getpid() or _pid_alive(pid):
                continue
        with contextlib.suppress(FileNotFoundError):
            candidate.unlink()
            log.info("removed stale checkpoint temp file %s", candidate)


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")


def atomic_write(path: Path, write: Callable[[Path], object], hook: bool = False) -> None:
    """Run ``write(tmp)``, fsync tmp, rename onto ``path``, fsync the directory.

    Any exception (including KeyboardInterrupt) removes the temp file and is re-raised;
    ``path`` is then left exactly as it was.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path)
    tmp = _temp_path(path)
    try:
        write(tmp)
        _fsync_path(tmp)
        if hook and _after_temp_written is not None:
            _after_temp_written(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old or the new file, whole.

    ``durable=False`` skips the fsyncs (fine for status files that are rewritten every second).
    """
    if durable:
        atomic_write(path, lambda tmp: tmp.write_bytes(data))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def save_checkpoint(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any] | None = None,
) -> str:
    """Atomically write ``tensors`` and JSON ``meta`` to ``path``; return the state hash.

    ``meta`` must be JSON-serialisable; its ``state_hash`` and ``format`` keys are
    overwritten. Tensors are stored as contiguous CPU clones, so tied/shared
    storage is fine. On any error the target is untouched and no temp file
    remains (TypeError/ValueError for bad input, OSError for I/O failures).
    """
    path = Path(path)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
    cpu = {
        name: t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        for name, t in tensors.items()
    }
    digest = state_hash(cpu)
    full_meta = dict(meta or {})
    full_meta["state_hash"] = digest
    full_meta["format"] = FORMAT_VERSION
    header = {META_KEY: json.dumps(full_meta, sort_keys=True)}
    atomic_write(path, lambda tmp: save_file(cpu, str(tmp), metadata=header), hook=True)
    return digest


def _read_meta(path: Path, handle: Any) -> dict[str, Any]:
    raw = handle.metadata()
    if not raw or META_KEY not in raw:
        raise CheckpointError(f"checkpoint '{path}' has no {META_KEY} metadata")
    try:
        meta = json.loads(raw[META_KEY])
    except ValueError as exc:
        raise CheckpointError(
            f"checkpoint '{path}' is corrupt: bad metadata: {_one_line(exc)}"
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("state_hash"), str):
        raise CheckpointError(f"checkpoint '{path}' is corrupt: metadata lacks a state_hash")
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint '{path}' has unsupported format {meta.get('format')!r}")
    return meta


def _open_checkpoint(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at '{path}'")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at '{path}'") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint '{path}' is corrupt: {_one_line(exc)}") from None


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """Return the stored metadata (incl. ``state_hash``, ``format``) without loading tensors.

    Raises CheckpointError if the file is missing, not a complete safetensors
    file, or lacks valid p2pdiloco metadata. Tensor data is not verified.
    """
    path = Path(path)
    with _open_checkpoint(path) as handle:
        return _read_meta(path, handle)


def load_checkpoint(path: str | Path, *, verify: bool = True, device: str = "cpu") -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Raises CheckpointError if the file is missing, corrupt or truncated, lacks
    metadata, or (with ``verify``) its tensors do not hash to the recorded
    state hash. With ``verify=False`` the returned ``state_hash`` is the recorded one.
    """
    path = Path(path)
    with _open_checkpoint(path) as handle:
        meta = _read_meta(path, handle)
        try:
            names = handle.keys()  # a safe_open handle is not iterable itself
            tensors = {name: handle.get_tensor(name) for name in names}
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: {_one_line(exc)}") from None
    recorded = meta["state_hash"]
    if verify:
        actual = state_hash(tensors)
        if actual != recorded:
            raise CheckpointError(
                f"checkpoint '{path}' failed verification: "
                f"state hash {actual} != recorded {recorded}"
            )
    if device != "cpu":
        tensors = {name: t.to(device) for name, t in tensors.items()}
    return Checkpoint(tensors=tensors, meta=meta, state_hash=recorded)


_CKPT_RE = re.compile(r"ckpt-(\d{8,})\.safetensors")


class CheckpointStore:
    """A directory of versioned checkpoints ``ckpt-<version:08d>.safetensors`` plus a ``LATEST`` pointer.

    Each save writes its file atomically, then atomically replaces ``LATEST``
    (JSON ``{"file", "state_hash", "version"}``), then prunes to the ``keep``
    files: the one just written and the highest-versioned others. A crash at any
    point leaves either the old or the new pointer, each naming a complete file.
    """

    LATEST = "LATEST"

    def __init__(self, directory: str | Path, *, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def path_for(self, version: int) -> Path:
        return self.directory / f"ckpt-{version:08d}.safetensors"

    def versions(self) -> list[int]:
        """Versions of the ``ckpt-*`` files present, newest first (files are not validated)."""
        if not self.directory.is_dir():
            return []
        found = (_CKPT_RE.fullmatch(p.name) for p in self.directory.iterdir())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def save(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> str:
        """Save ``tensors`` as ``meta["version"]`` and point ``LATEST`` at it; return the state hash.

        Raises ValueError if ``meta`` lacks a non-negative int ``version``. Saving
        an existing version replaces that file. I/O errors propagate; the previous
        ``LATEST`` stays valid unless the error happens during pruning.
        """
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"meta must contain a non-negative int 'version', got {version!r}")
        target = self.path_for(version)
        digest = save_checkpoint(target, tensors, meta)
        pointer = json.dumps({"file": target.name, "state_hash": digest, "version": version})
        atomic_write(self.directory / self.LATEST, lambda tmp: tmp.write_text(pointer))
        others = [v for v in self.versions() if v != version]
        for old in others[self.keep - 1 :]:
            with contextlib.suppress(FileNotFoundError):
                self.path_for(old).unlink()
        return digest

    def _load_pointer(self, verify: bool) -> tuple[Checkpoint | None, str | None]:
        """Return (checkpoint, None), else (None, name of a file that failed to load, if any)."""
        pointer_path = self.directory / self.LATEST
        try:
            pointer = json.loads(pointer_path.read_text())
            name = pointer["file"]
            recorded = pointer["state_hash"]
        except FileNotFoundError:
            if self.versions():
                log.warning(
                    "no %s in '%s'; falling back to newest valid", self.LATEST, self.directory
                )
            return None, None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable %s in '%s': %s", self.LATEST, self.directory, _one_line(exc))
            return None, None
        if not isinstance(name, str) or not _CKPT_RE.fullmatch(name):
            log.warning("%s in '%s' names invalid file %r", self.LATEST, self.directory, name)
            return None, None
        try:
            ckpt = load_checkpoint(self.directory / name, verify=verify)
        except CheckpointError as exc:
            log.warning("%s points to a bad checkpoint: %s", self.LATEST, exc)
            return None, name
        if ckpt.state_hash != recorded:
            # A crash between rewriting a version's file and LATEST: the file itself may be
            # fine, so the fallback scan may still pick it.
            log.warning(
                "%s records state hash %s but '%s' has %s",
                self.LATEST,
                recorded,
                name,
                ckpt.state_hash,
            )
            return None, None
        return ckpt, None

    def load_latest(self, verify: bool = True) -> Checkpoint | None:
        """Load the checkpoint named by ``LATEST``, else the newest valid ``ckpt-*`` file.

        Every fallback is logged as a warning. Returns None if no valid
        checkpoint exists (including a missing directory); never raises
        CheckpointError.
        """
        ckpt, tried = self._load_pointer(verify)
        if ckpt is not None:
            return ckpt
        for version in self.versions():
            path = self.path_for(version)
            if path.name == tried:
                continue
            try:
                ckpt = load_checkpoint(path, verify=verify)
            except CheckpointError as exc:
                log.warning("skipping bad checkpoint: %s", exc)
                continue
            log.warning("falling back to checkpoint '%s'", path)
            return ckpt
        return None
