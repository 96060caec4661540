"""Settings precedence (flags > env > config file > built-in) and the keys CLI."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from p2pdiloco import config
from p2pdiloco.errors import ConfigError
from tests.netutil import run_cli as forked_cli

A, B, C = "/ip4/1.1.1.1/tcp/1/p2p/x", "/ip4/2.2.2.2/tcp/2/p2p/y", "/ip4/3.3.3.3/tcp/3/p2p/z"


def test_bootstrap_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"P2PDILOCO_BOOTSTRAP": f"{B}, {C}"}
    cfg = {"bootstrap": [C]}
    assert config.resolve_bootstrap([A], env=env, config=cfg) == ([A], "--bootstrap")
    assert config.resolve_bootstrap(None, env=env, config=cfg)[0] == [B, C]
    assert config.resolve_bootstrap(None, env={}, config=cfg)[0] == [C]
    monkeypatch.setattr(config, "COMMUNITY_BOOTSTRAP", (A,))
    assert config.resolve_bootstrap(None, env={}, config={}) == ([A], "built-in community list")
    with pytest.raises(ConfigError):
        config.resolve_bootstrap(None, env={}, config={"bootstrap": 3})


def test_generic_setting_precedence() -> None:
    assert config.resolve("port", 1, 9, env={"P2PDILOCO_PORT": "2"}, config={"port": 3}) == 1
    assert config.resolve("port", None, 9, env={"P2PDILOCO_PORT": "2"}, config={"port": 3}) == "2"
    assert config.resolve("port", None, 9, env={}, config={"port": 3}) == 3
    assert config.resolve("port", None, 9, env={}, config={}) == 9


def test_config_file_is_read_and_bad_toml_is_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "p2pdiloco").mkdir()
    (tmp_path / "p2pdiloco" / "config.toml").write_text(f'bootstrap = ["{A}"]\n')
    assert config.load_config_file() == {"bootstrap": [A]}
    (tmp_path / "p2pdiloco" / "config.toml").write_text("bootstrap = [\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        config.load_config_file()


def cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_DATA_HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg")}
    return forked_cli(*args, env=env, timeout=120)


def test_keys_new_show_and_refuse_overwrite(tmp_path: Path) -> None:
    out = cli("keys", "new", home=tmp_path)
    assert out.returncode == 0, out.stderr
    key = tmp_path / "p2pdiloco" / "identity.key"
    assert key.stat().st_mode & 0o777 == 0o600
    shown = json.loads(cli("keys", "show", "--json", home=tmp_path).stdout)
    assert shown["peer_id"].startswith("12D3KooW") and shown["peer_id"] in out.stdout
    again = cli("keys", "new", home=tmp_path)
    assert again.returncode == 2 and "--force" in again.stderr
    assert json.loads(cli("keys", "show", "--json", home=tmp_path).stdout) == shown


def test_join_without_any_bootstrap_is_one_line(tmp_path: Path) -> None:
    out = cli("join", "--model", "gemma-tiny", home=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error: no bootstrap server configured")
    assert "Traceback" not in out.stderr


def test_join_refuses_a_model_that_does_not_fit_within_seconds(tmp_path: Path) -> None:
    import time

    t0 = time.monotonic()
    out = cli(
        "join", "--model", "gemma-12b", "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/x", home=tmp_path
    )
    elapsed = time.monotonic() - t0
    assert out.returncode == 2 and "Traceback" not in out.stderr
    line = out.stderr.strip()
    assert line.startswith("error: gemma-12b needs about") and "GiB" in line and "would fit" in line
    assert elapsed < 60  # no network, no allocation: only imports and a memory probe


def test_join_settings_flags_over_env_over_config_file(tmp_path: Path, monkeypatch) -> None:
    from p2pdiloco.cli.join_config import _gpus, _typed
    from p2pdiloco.errors import ConfigError

    conf = {"batch_size": 2, "max_memory": 10.0, "device": "cpu", "gpus": "1"}
    monkeypatch.setenv("P2PDILOCO_BATCH_SIZE", "4")
    monkeypatch.delenv("P2PDILOCO_MAX_MEMORY", raising=False)
    assert _typed("batch_size", 8, None, int, conf) == 8  # flag
    assert _typed("batch_size", None, None, int, conf) == 4  # env (a string, cast)
    assert _typed("max_memory", None, None, float, conf) == 10.0  # config file
    assert _typed("metrics_port", None, None, int, conf) is None  # default
    monkeypatch.setenv("P2PDILOCO_PORT", "not-a-port")
    with pytest.raises(ConfigError, match="port"):
        _typed("port", None, 0, int, conf)
    assert _gpus(_typed("gpus", None, None, str, conf)) == (1,)
    assert _gpus("0,2") == (0, 2)
    for bad in ("0,x", "-1", "1,1"):
        with pytest.raises(ConfigError):
            _gpus(bad)


def test_join_rejects_a_bad_gpus_flag_in_one_line(tmp_path: Path) -> None:
    out = cli("join", "--model", "gemma-tiny", "--gpus", "0,x", home=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith("error: --gpus")


def test_join_config_from_flags_env_and_config_file(tmp_path: Path, monkeypatch) -> None:
    """``JoinConfig.from_flags`` is ``join`` resolved in one place: each setting from its flag,
    else P2PDILOCO_<NAME>, else the config file, else its default, cast; the others as given."""
    from p2pdiloco.cli.join_config import JoinConfig

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "p2pdiloco").mkdir()
    (tmp_path / "p2pdiloco" / "config.toml").write_text(
        f'bootstrap = ["{C}"]\nbatch_size = 2\nmax_memory = 10\nstate_dir = "/srv/p2p"\n'
    )
    for name in ("BOOTSTRAP", "MODEL", "RUN", "PORT", "DEVICE", "GPUS", "MAX_MEMORY"):
        monkeypatch.delenv(f"P2PDILOCO_{name}", raising=False)
    monkeypatch.setenv("P2PDILOCO_BATCH_SIZE", "4")
    monkeypatch.setenv("P2PDILOCO_COMPUTE_SHARE", "0.5")
    flags = {"model": "gemma-tiny", "gpus": "0,2", "announce": [A], "no_gossip": True}
    cfg = JoinConfig.from_flags(flags)
    assert cfg == JoinConfig(
        bootstrap=(C,),
        bootstrap_source=f"config {tmp_path / 'p2pdiloco' / 'config.toml'}",
        model="gemma-tiny",
        gpus=(0, 2),
        announce=(A,),
        no_gossip=True,
        batch_size=4,  # env over the file
        compute_share=0.5,  # env, cast
        max_memory=10.0,  # the file, cast
        state_dir=Path("/srv/p2p"),
    )
    node = cfg.node_config()
    assert (node.bootstrap, node.announce, node.gossip, node.port) == ([C], [A], False, 0)
    assert JoinConfig.from_flags({**flags, "bootstrap": [B]}).bootstrap == (B,)
    for bad, match in (
        ({"lan_island": True}, "--lan-island needs --island"),
        ({"compute_share": 1.5}, "--compute-share"),
        ({"model": None}, "--model NAME"),
        ({"batch_size": 0}, "--batch-size"),
        ({"bootstrap": ["/ip4/1.1.1.1"]}, "bad bootstrap address"),
    ):
        with pytest.raises(ConfigError, match=match):
            JoinConfig.from_flags({**flags, **bad})
