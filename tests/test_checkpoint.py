"""Tests for p2pdiloco.train.checkpoint: hashing, round trips, corruption, real-kill atomicity."""

from __future__ import annotations

import logging
import os
import queue
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from p2pdiloco.train import checkpoint
from p2pdiloco.train.checkpoint import (
    CheckpointError,
    CheckpointStore,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
    state_hash,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

# Evaluated both here and in a child process, so it must be deterministic.
DETERMINISTIC = (
    "{'w': torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,"
    " 'h': (torch.arange(5, dtype=torch.float32) / 3).to(torch.bfloat16),"
    " 'n': torch.tensor([-1, 2**40], dtype=torch.int64),"
    " 's': torch.tensor(True)}"
)
# Pinned so that any change to the canonical layout (which signatures depend on) is noticed.
DETERMINISTIC_HASH = "28f272dc67d13b37a52acba44b0159e01a2e746c876f2da652f76ede32e08ad7"


def _deterministic() -> dict[str, torch.Tensor]:
    return eval(DETERMINISTIC, {"torch": torch})


def _sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(8, 5, generator=gen),
        "layer.bias_bf16": torch.randn(5, generator=gen).to(torch.bfloat16),
        "step": torch.tensor([7, -3, 2**40], dtype=torch.int64),
    }


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def _data_offset(path: Path) -> int:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    return 8 + header_len


def _flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _temps(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.tmp-*"))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


# --- hashing -----------------------------------------------------------------------------------


def test_state_hash_independent_of_insertion_order_and_layout() -> None:
    tensors = _sample()
    reordered = dict(reversed(list(tensors.items())))
    assert state_hash(tensors) == state_hash(reordered)
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    assert state_hash({"t": base.T}) == state_hash({"t": base.T.contiguous()})


def test_state_hash_changes_with_content_dtype_shape_and_name() -> None:
    tensors = _sample()
    reference = state_hash(tensors)
    changed = dict(tensors)
    changed["layer.weight"] = tensors["layer.weight"].clone()
    changed["layer.weight"][3, 2] += 1e-3
    assert state_hash(changed) != reference
    zeros = torch.zeros(4, dtype=torch.float32)
    assert state_hash({"z": zeros}) != state_hash({"z": zeros.view(torch.int32)})
    assert state_hash({"z": zeros}) != state_hash({"z": zeros.reshape(2, 2)})
    assert state_hash({"z": zeros}) != state_hash({"y": zeros})


def test_state_hash_identical_in_subprocess_and_pinned() -> None:
    script = (
        "import torch\n"
        "from p2pdiloco.train.checkpoint import state_hash\n"
        f"print(state_hash({DETERMINISTIC}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=_child_env(),
        timeout=120,
        check=True,
    )
    local = state_hash(_deterministic())
    assert result.stdout.strip() == local
    assert local == DETERMINISTIC_HASH


# --- round trip --------------------------------------------------------------------------------


def test_roundtrip_fp32_bf16_int64_with_meta(tmp_path: Path) -> None:
    tensors = _sample()
    meta = {"version": 3, "note": "hello", "nested": {"a": [1, 2.5, None]}}
    path = tmp_path / "sub" / "dir" / "ckpt.safetensors"
    digest = save_checkpoint(path, tensors, meta)
    assert digest == state_hash(tensors)
    loaded = load_checkpoint(path)
    _assert_same(loaded.tensors, tensors)
    assert loaded.state_hash == digest
    assert loaded.meta == {**meta, "state_hash": digest, "format": 1}
    assert read_checkpoint_meta(path) == loaded.meta
    assert _temps(path) == []


def test_save_handles_shared_and_noncontiguous_storage(tmp_path: Path) -> None:
    weight = torch.randn(6, 4)
    tensors = {"embed": weight, "lm_head": weight, "half": weight[:3], "t": weight.T}
    path = tmp_path / "tied.safetensors"
    digest = save_checkpoint(path, tensors)
    loaded = load_checkpoint(path)
    _assert_same(loaded.tensors, {k: v.contiguous() for k, v in tensors.items()})
    assert loaded.state_hash == digest


def test_failed_save_leaves_target_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.safetensors"
    original = save_checkpoint(path, _sample(), {"name": "A"})

    def boom(tmp: Path) -> None:
        assert tmp.is_file()
        raise RuntimeError("injected")

    monkeypatch.setattr(checkpoint, "_after_temp_written", boom)
    with pytest.raises(RuntimeError, match="injected"):
        save_checkpoint(path, {"x": torch.ones(3)}, {"name": "B"})
    assert _temps(path) == []
    assert load_checkpoint(path).state_hash == original


# --- corruption --------------------------------------------------------------------------------


def test_flipped_data_byte_fails_verification(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, _sample())
    _flip_byte(path, _data_offset(path) + 5)
    with pytest.raises(CheckpointError, match="failed verification: state hash"):
        load_checkpoint(path)
    load_checkpoint(path, verify=False)


def test_truncated_file_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, _sample())
    size = path.stat().st_size
    os.truncate(path, size - 7)
    with pytest.raises(CheckpointError, match="is corrupt"):
        load_checkpoint(path)
    os.truncate(path, 5)
    with pytest.raises(CheckpointError, match="is corrupt"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="is corrupt"):
        read_checkpoint_meta(path)


def test_not_a_safetensors_file_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    path.write_bytes(b"this is definitely not a safetensors file")
    with pytest.raises(CheckpointError, match="is corrupt"):
        load_checkpoint(path)


def test_missing_file_and_missing_metadata(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "absent.safetensors")
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.ones(2)}, str(plain))
    with pytest.raises(CheckpointError, match="no p2pdiloco metadata"):
        load_checkpoint(plain)


# --- atomicity with real kills -----------------------------------------------------------------


class _Child:
    """A child Python process whose stdout lines are pumped into a queue by a thread."""

    def __init__(self, script: str, *args: str, stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        self._stderr = stderr_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=_child_env(),
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def wait_for(self, marker: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(remaining, 0.0))
            except queue.Empty:
                pytest.fail(f"child did not print {marker!r} within {timeout}s")
            if line == "":
                self.proc.wait(timeout=10)
                err = self.stderr_path.read_text(errors="replace")[-2000:]
                pytest.fail(f"child exited ({self.proc.returncode}) before {marker!r}:\n{err}")
            if line.strip() == marker:
                return

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._stderr.close()


HOOKED_WRITER = """
import signal, sys
import torch
from p2pdiloco.train import checkpoint

def hang(tmp):
    print("READY", flush=True)
    while True:
        signal.pause()  # block until the test kills this process

checkpoint._after_temp_written = hang
big = {"big": torch.arange(2_000_000, dtype=torch.float32)}
checkpoint.save_checkpoint(sys.argv[1], big, {"name": "B"})
"""


def test_kill_before_rename_keeps_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    tensors_a = _sample()
    hash_a = save_checkpoint(path, tensors_a, {"name": "A"})

    child = _Child(HOOKED_WRITER, str(path), stderr_path=tmp_path / "child.err")
    try:
        child.wait_for("READY")
    finally:
        child.kill()
    assert child.proc.returncode == -signal.SIGKILL

    (stale,) = _temps(path)
    assert stale.stat().st_size > 8_000_000, "the temp file should have been complete"
    loaded = load_checkpoint(path)
    assert loaded.state_hash == hash_a
    assert loaded.meta["name"] == "A"
    _assert_same(loaded.tensors, tensors_a)

    hash_c = save_checkpoint(path, {"c": torch.ones(4)}, {"name": "C"})
    assert _temps(path) == []
    assert load_checkpoint(path).state_hash == hash_c


LOOPING_WRITER = """
import sys
import torch
from p2pdiloco.train import checkpoint

big = {"x": torch.ones(50_000_000)}  # 200 MB
print("STARTED", flush=True)
while True:
    checkpoint.save_checkpoint(sys.argv[1], big, {"name": "B"})
"""


def test_kill_at_random_point_never_leaves_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    hash_a = save_checkpoint(path, _sample(), {"name": "A"})
    rng = random.Random()
    outcomes = []
    # Stratified delays spread the kills over about 1.5 saves of 200 MB.
    for stratum in range(3):
        delay = rng.uniform(0.5 * stratum, 0.5 * (stratum + 1))
        child = _Child(LOOPING_WRITER, str(path), stderr_path=tmp_path / f"child{stratum}.err")
        try:
            child.wait_for("STARTED")
            with pytest.raises(subprocess.TimeoutExpired):
                child.proc.wait(timeout=delay)
        finally:
            child.kill()
        left_temp = bool(_temps(path))
        loaded = load_checkpoint(path)  # raises if the target is partial or corrupt
        assert loaded.meta["name"] in {"A", "B"}, f"delay {delay:.3f}s"
        if loaded.meta["name"] == "A":
            assert loaded.state_hash == hash_a
        outcomes.append((round(delay, 3), loaded.meta["name"], left_temp))
    print("kill outcomes (delay, target, temp left):", outcomes)

    save_checkpoint(path, {"c": torch.ones(4)}, {"name": "C"})
    assert _temps(path) == []
    assert load_checkpoint(path).meta["name"] == "C"


# --- CheckpointStore ---------------------------------------------------------------------------


def _save_versions(store: CheckpointStore, versions: list[int]) -> dict[int, str]:
    return {v: store.save({"w": torch.full((3,), float(v))}, {"version": v}) for v in versions}


def test_store_keeps_two_most_recent(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store")
    hashes = _save_versions(store, [1, 2, 3])
    latest = store.load_latest()
    assert latest is not None
    assert latest.meta["version"] == 3
    assert latest.state_hash == hashes[3]
    assert store.versions() == [3, 2]
    names = sorted(p.name for p in store.directory.iterdir())
    assert names == ["LATEST", "ckpt-00000002.safetensors", "ckpt-00000003.safetensors"]


def test_store_falls_back_when_latest_file_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    hashes = _save_versions(store, [1, 2, 3])
    newest = store.path_for(3)
    _flip_byte(newest, _data_offset(newest) + 1)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        latest = store.load_latest()
    assert latest is not None
    assert latest.meta["version"] == 2
    assert latest.state_hash == hashes[2]
    assert any("failed verification" in r.getMessage() for r in caplog.records)
    assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_store_falls_back_without_latest_pointer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    _save_versions(store, [1, 2, 3])
    (tmp_path / "LATEST").unlink()
    store.path_for(3).write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        latest = store.load_latest()
    assert latest is not None
    assert latest.meta["version"] == 2
    assert any("no LATEST" in r.getMessage() for r in caplog.records)


def test_store_empty_and_invalid_version(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path / "never-created")
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        assert store.load_latest() is None
    assert caplog.records == []
    for meta in ({}, {"version": "3"}, {"version": True}, {"version": -1}):
        with pytest.raises(ValueError, match="version"):
            store.save({"w": torch.ones(1)}, meta)
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)
