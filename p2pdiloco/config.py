"""Settings from outside the library, read in one place: flags > env > config file > defaults.

Environment variables are ``P2PDILOCO_<NAME>`` (upper case); the config file is TOML at
``$XDG_CONFIG_HOME/p2pdiloco/config.toml`` (default ``~/.config/p2pdiloco/config.toml``), with
the same names in lower case (``bootstrap = ["/ip4/..."]``). Library code never reads the
environment itself: the CLI resolves settings here and passes plain values down.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pdiloco.errors import ConfigError
from p2pdiloco.net.community import COMMUNITY_BOOTSTRAP

ENV_PREFIX = "P2PDILOCO_"
# Every setting read through here (``join``'s options and the bootstrap list); a key outside
# this set is a typo, refused rather than silently ignored.
CONFIG_KEYS = frozenset(
    {
        "bootstrap",
        "model",
        "run",
        "identity",
        "port",
        "device",
        "gpus",
        "island_ranks",
        "island_secret",
        "max_memory",
        "batch_size",
        "cache_dir",
        "state_dir",
        "metrics_port",
        "compute_share",
    }
)


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "p2pdiloco" / "config.toml"


def load_config_file(path: Path | None = None) -> dict[str, Any]:
    """The config file as a dict ({} if absent). ConfigError naming the file if it is not valid
    TOML, and naming the key (with the nearest valid one) if it holds a key outside
    :data:`CONFIG_KEYS`."""
    path = path or config_path()
    if not path.exists():
        return {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config file '{path}': {e}") from e
    for key in data:
        if key not in CONFIG_KEYS:
            near = difflib.get_close_matches(key, sorted(CONFIG_KEYS), n=1)
            hint = (
                f"did you mean '{near[0]}'?" if near else f"known: {', '.join(sorted(CONFIG_KEYS))}"
            )
            raise ConfigError(
                f"unknown setting '{key}' in config file '{path}' ({hint}); fix or remove it"
            )
    return data


def resolve(
    name: str,
    flag: Any,
    default: Any,
    *,
    env: Mapping[str, str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> Any:
    """One setting: the flag if given (not None), else env, else config file, else default."""
    if flag is not None:
        return flag
    env = os.environ if env is None else env
    if (value := env.get(ENV_PREFIX + name.upper())) is not None:
        return value
    config = load_config_file() if config is None else config
    if name in config:
        return config[name]
    return default


def resolve_bootstrap(
    flags: Sequence[str] | None,
    *,
    env: Mapping[str, str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> tuple[list[str], str]:
    """Bootstrap multiaddrs and where they came from ("--bootstrap", "env", "config", "builtin").

    ``P2PDILOCO_BOOTSTRAP`` holds one or more addresses separated by commas or spaces.
    """
    if flags:
        return list(flags), "--bootstrap"
    env = os.environ if env is None else env
    if value := env.get(ENV_PREFIX + "BOOTSTRAP"):
        return [a for a in value.replace(",", " ").split() if a], f"env {ENV_PREFIX}BOOTSTRAP"
    config = load_config_file() if config is None else config
    if "bootstrap" in config:
        addrs = config["bootstrap"]
        if isinstance(addrs, str):
            addrs = [addrs]
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise ConfigError("config 'bootstrap' must be a list of multiaddr strings")
        return list(addrs), f"config {config_path()}"
    return list(COMMUNITY_BOOTSTRAP), "built-in community list"
