"""Bad input gives one line, a non-zero exit and no traceback, before any work starts.

In process through typer's runner where the check comes before any network start; one real
subprocess shows the same for a taken port end to end. Every port here is held by the test
itself (a listening socket on loopback), so nothing depends on what else runs on the machine.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from p2pdiloco import config
from p2pdiloco.cli.app import app
from p2pdiloco.errors import ConfigError
from p2pdiloco.preflight import PreflightConfig, check_disk
from p2pdiloco.runtime.chain import ChainStore
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.train import checkpoint
from p2pdiloco.train.sources import DataError, iter_documents

PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def addr(port: int) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER}"


@pytest.fixture(autouse=True)
def _own_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No real config file, identity or state dir is read or written."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    for name in ("BOOTSTRAP", "PORT", "METRICS_PORT", "STATE_DIR"):
        monkeypatch.delenv(f"P2PDILOCO_{name}", raising=False)


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port some other program is listening on (on loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def one_error_line(args: list[str], code: int = 2) -> str:
    """Run the CLI in process; assert the exit code, no traceback and one ``error:`` line."""
    result = CliRunner().invoke(app, args)
    out = result.stdout + result.stderr
    assert result.exit_code == code, out
    assert "Traceback" not in out
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    [line] = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert line.startswith("error: ")
    return line


def join_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "join",
        "--model",
        "gemma-tiny",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--state-dir",
        str(tmp_path / "state"),
        "--no-tui",
        *extra,
    ]


# --- ports ----------------------------------------------------------------------------------


def test_bootstrap_dht_port_in_use(tmp_path: Path, held_port: int) -> None:
    line = one_error_line(
        [
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            str(held_port),
            "--http-port",
            "0",
            "--identity",
            str(tmp_path / "boot.key"),
        ]
    )
    assert line == (
        f"error: cannot listen on 127.0.0.1:{held_port} for the DHT: the port is already in "
        f"use; stop what holds it (`ss -ltnp 'sport = :{held_port}'` shows it) or pass another "
        "--port"
    )
    assert not (tmp_path / "boot.key").exists()  # refused before anything was made


def test_bootstrap_http_port_in_use(tmp_path: Path, held_port: int) -> None:
    line = one_error_line(
        [
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(held_port),
            "--identity",
            str(tmp_path / "boot.key"),
        ]
    )
    assert f"127.0.0.1:{held_port} for the HTTP API: the port is already in use" in line
    assert line.endswith("or pass another --http-port")


def test_join_dht_port_in_use(tmp_path: Path, held_port: int) -> None:
    line = one_error_line(
        join_args(tmp_path, "--bootstrap", addr(9), "--port", str(held_port), "--no-gossip")
    )
    assert f"127.0.0.1:{held_port} for the DHT: the port is already in use" in line


def test_join_metrics_port_in_use(tmp_path: Path, held_port: int) -> None:
    line = one_error_line(
        join_args(tmp_path, "--bootstrap", addr(9), "--metrics-port", str(held_port))
    )
    assert f"127.0.0.1:{held_port} for the metrics server: the port is already in use" in line
    assert line.endswith("or pass another --metrics-port")


def test_bootstrap_port_in_use_real_process_fails_fast(tmp_path: Path, held_port: int) -> None:
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2pdiloco",
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            str(held_port),
            "--http-port",
            "0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert out.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{held_port} for the DHT: the port is already in "
        f"use; stop what holds it (`ss -ltnp 'sport = :{held_port}'` shows it) or pass another "
        "--port"
    ]
    assert out.stdout == ""  # no address it does not own
    assert time.monotonic() - t0 < 60  # imports only: no daemon was started


# --- bootstrap addresses --------------------------------------------------------------------


def test_join_garbage_bootstrap_is_refused_up_front(tmp_path: Path) -> None:
    line = one_error_line(join_args(tmp_path, "--bootstrap", "garbage"))
    assert line == (
        "error: bad bootstrap address 'garbage' (from --bootstrap): expected "
        "/ip4/HOST/tcp/PORT/p2p/PEER_ID; copy the full multiaddr the bootstrap server prints at "
        "start, like /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
    )


def test_bad_bootstrap_names_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PDILOCO_BOOTSTRAP", "/ip4/1.2.3.999/tcp/1/p2p/" + PEER)
    line = one_error_line(["status"])
    assert "'1.2.3.999' is not an ip4 address" in line and "(from env P2PDILOCO_BOOTSTRAP)" in line
    line = one_error_line(
        ["bootstrap", "--port", "0", "--http-port", "0", "--peer", "/ip4/1.2.3.4/udp/1"]
    )
    assert "bad bootstrap address '/ip4/1.2.3.4/udp/1' (from --peer)" in line


# --- state dir and disk ---------------------------------------------------------------------


def test_unwritable_state_dir_is_an_error_in_doctor_and_join(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    f = check_disk(PreflightConfig(model="gemma-tiny", state_dir=a_file / "state"))
    assert f.severity == "error" and "not a directory" in f.detail and "--state-dir" in f.fix
    args = join_args(tmp_path, "--bootstrap", addr(9))
    args[args.index("--state-dir") + 1] = str(a_file / "state")
    line = one_error_line(args)
    assert line == (
        f"error: disk: cannot write checkpoints under {a_file / 'state'} (--state-dir): "
        f"{a_file}: not a directory; fix: pass --state-dir on a writable disk, or make that "
        "directory writable"
    )


def test_read_only_state_dir_is_found_by_a_real_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def read_only(*args: object, **kwargs: object) -> tuple[int, str]:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    f = check_disk(PreflightConfig(model="gemma-tiny", state_dir=tmp_path))
    assert f.severity == "error"
    assert f"{tmp_path}: Read-only file system" in f.detail


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 directory")
def test_state_dir_without_write_permission(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    f = check_disk(PreflightConfig(model="gemma-tiny", state_dir=locked / "run"))
    assert f.severity == "error" and "Permission denied" in f.detail


def test_disk_need_is_three_checkpoints_of_the_model(tmp_path: Path) -> None:
    f = check_disk(PreflightConfig(model="gemma-tiny", state_dir=tmp_path))
    assert "(3 checkpoints of gemma-tiny + 1 GiB)" in f.detail


def _state(version: int) -> CertifiedState:
    class Cert:  # persist reads only the certificate's raw bytes, version and derived roster
        raw = b'{"cert": %d}' % version
        body = SimpleNamespace(version=version)
        roster = ()

    params = {"w": torch.full((64,), float(version))}
    return CertifiedState(version, Cert(), params, {"w": torch.zeros(64)})  # type: ignore[arg-type]


def test_disk_full_on_a_checkpoint_write_is_one_line_and_keeps_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chain = ChainStore(tmp_path, "run")
    chain.persist([], _state(1))
    assert chain.failure is None and chain.saved == 1

    def full(tensors: object, path: str, metadata: object = None) -> None:
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "save_file", full)
    chain.persist([], _state(2))
    assert chain.saved == 1
    assert chain.failure is not None and "\n" not in chain.failure
    assert chain.failure.startswith(
        f"cannot save certified version 2 under {tmp_path}: No space left on device; "
        f"version 1 stays saved there; free space"
    )
    assert chain.failure.endswith("or join again with --state-dir on a larger disk")
    monkeypatch.undo()
    ckpt = chain.store.load_latest(verify=True)
    assert ckpt is not None and ckpt.meta["version"] == 1
    assert sorted(p.name for p in (tmp_path / "certified").iterdir()) == [
        "LATEST",
        "ckpt-00000001.safetensors",
    ]  # no temp file left behind


# --- data -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["elf", "random"])
def test_binary_data_file_is_refused(tmp_path: Path, kind: str) -> None:
    blob = tmp_path / "corpus"
    if kind == "elf":
        blob.write_bytes(Path(sys.executable).resolve().read_bytes()[:65536])
    else:
        blob.write_bytes(bytes(torch.randint(1, 256, (65536,), dtype=torch.uint8).tolist()))
    with pytest.raises(DataError) as e:
        iter_documents(str(blob))  # eagerly: before any corpus work starts
    msg = str(e.value)
    assert msg.startswith(f"data file '{blob}' is not text (")
    assert msg.endswith(
        "; pass UTF-8 text (.txt, .md, .jsonl or extension-less files), a directory of them, "
        "or hf:NAME"
    )
    assert ("NUL bytes" in msg) if kind == "elf" else ("are not UTF-8" in msg)


def test_simulate_on_a_binary_file_is_one_line(tmp_path: Path) -> None:
    blob = tmp_path / "a-binary"
    blob.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(4096))
    line = one_error_line(["simulate", "--data", str(blob), "--json"])
    assert line.startswith(f"error: data file '{blob}' is not text (it holds NUL bytes")


def test_a_binary_file_in_a_data_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text " * 50)
    (tmp_path / "b").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(DataError, match=f"data file '{tmp_path / 'b'}' is not text"):
        list(iter_documents(str(tmp_path)))


def test_text_with_a_few_odd_bytes_still_reads(tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("héllo wörld café ".encode("latin-1") * 100)
    [doc] = list(iter_documents(str(tmp_path / "latin1.txt")))
    assert doc.text.startswith("h\ufffdllo")


# --- config file ----------------------------------------------------------------------------


def test_config_typo_is_refused_with_the_nearest_key(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "p2pdiloco" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text('stat_dir = "/srv/p2p"\n')
    with pytest.raises(ConfigError) as e:
        config.load_config_file()
    assert str(e.value) == (
        f"unknown setting 'stat_dir' in config file '{path}' (did you mean 'state_dir'?); "
        "fix or remove it"
    )
    line = one_error_line(["doctor"])
    assert line == f"error: {e.value}"
    path.write_text("zzz = 1\n")
    with pytest.raises(ConfigError, match="'zzz'.*known: batch_size, bootstrap, cache_dir"):
        config.load_config_file()


def test_every_join_setting_is_a_known_config_key() -> None:
    from p2pdiloco.cli.join_config import SETTINGS

    read = set(SETTINGS)
    assert read and read <= config.CONFIG_KEYS
    assert "bootstrap" in config.CONFIG_KEYS
    assert read | {"bootstrap"} == config.CONFIG_KEYS  # and every config key is read


def test_joins_options_map_straight_onto_its_config() -> None:
    """``join``'s typer options are ``JoinConfig``'s fields by name (``from_flags`` takes them
    as they are), and each field has the option's default."""
    import dataclasses
    import inspect

    from p2pdiloco.cli.join_cmd import join
    from p2pdiloco.cli.join_config import SETTINGS, JoinConfig

    options = inspect.signature(join).parameters
    fields = {f.name: f for f in dataclasses.fields(JoinConfig)}
    assert set(options) == set(fields) - {"bootstrap_source"}
    for name, option in options.items():
        default = SETTINGS[name][1] if name in SETTINGS else option.default
        if name in ("bootstrap", "announce", "gpus"):
            assert option.default is None and fields[name].default == ()
        else:
            assert fields[name].default == default, name
