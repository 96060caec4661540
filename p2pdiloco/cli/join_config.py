"""``join``'s settings as one typed value: its options resolved (flags > env ``P2PDILOCO_*`` >
config file > defaults, through :mod:`p2pdiloco.config`) and checked, before anything heavy is
imported, so a mistyped setting fails in one line within a second. ``join``'s typer options
are this dataclass's fields, by name; the node is assembled from it in ``join_cmd.run_join``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pdiloco.cli.net_common import bootstrap_addrs
from p2pdiloco.config import load_config_file, resolve
from p2pdiloco.errors import ConfigError
from p2pdiloco.island.secret import parse_secret
from p2pdiloco.net import keys
from p2pdiloco.train.model_specs import get_spec

if TYPE_CHECKING:  # hivemind, torch: the library's configs are built once the settings are good
    from p2pdiloco.island.spec import IslandSpec
    from p2pdiloco.node import NodeConfig
    from p2pdiloco.preflight import PreflightConfig
    from p2pdiloco.runtime.launch import TrainConfig

# The settings an environment variable or the config file may also give: name → its type and
# default (the config file's keys, ``config.CONFIG_KEYS``, are these and ``bootstrap``).
SETTINGS: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "model": (str, None),
    "run": (str, None),
    "identity": (Path, None),
    "port": (int, 0),
    "device": (str, "auto"),
    "gpus": (str, None),
    "island_ranks": (int, None),
    "max_memory": (float, None),
    "batch_size": (int, None),
    "cache_dir": (Path, None),
    "state_dir": (Path, None),
    "metrics_port": (int, None),
    "compute_share": (float, 1.0),
    "island_secret": (str, None),  # hex; parsed in ``from_flags``
}


@dataclass(frozen=True)
class JoinConfig:
    """Everything ``p2pdiloco join`` runs with, resolved and checked (see :meth:`from_flags`)."""

    bootstrap: tuple[str, ...] = ()  # bootstrap multiaddrs, checked well-formed
    bootstrap_source: str = ""  # where they came from ("--bootstrap", "env ...", ...), logged
    model: str | None = None  # join the most active run of this model ...
    run: str | None = None  # ... or this run id (or a unique prefix)
    identity: Path | None = None  # key file; None: the XDG data path
    host: str = "0.0.0.0"  # interface to listen on
    port: int = 0  # DHT TCP port (gossip: port + 1); 0: random
    announce: tuple[str, ...] = ()  # public multiaddrs to advertise
    island: str | None = None  # island name; None: island-<end of the peer id>, never the host's
    device: str = "auto"  # auto, cpu, cuda[:N], mps or xla
    gpus: tuple[int, ...] = ()  # CUDA devices; several form an island, one rank per GPU
    island_ranks: int | None = None  # processes training this node's learner together (gloo)
    offload: bool = False  # a CUDA island keeps optimizer state and weights in host RAM
    lan_island: bool = False  # form or join the LAN island named by ``island``
    # The LAN island's secret (32 bytes, given as 64 hex digits): a member needs its leader's;
    # a leader without one makes one and prints it (``island.sealed``).
    island_secret: bytes | None = field(default=None, repr=False)
    max_memory: float | None = None  # GiB this node may use; None: what is free
    batch_size: int | None = None  # sequences per micro-batch; None: auto, printed
    cache_dir: Path | None = None  # Hugging Face cache for tokenizers and weights
    state_dir: Path | None = None  # certified states and receipts; None: XDG data / run id
    threads: int | None = None  # CPU threads for torch; None: torch's choice
    compute_share: float = 1.0  # share of time to train, in (0, 1]
    no_tui: bool = False  # plain log lines instead of the dashboard
    json_logs: bool = False  # one JSON object per log line
    metrics_port: int | None = None  # serve Prometheus /metrics on this port
    no_gossip: bool = False  # DHT polling only
    heartbeat_interval: float = keys.HEARTBEAT_INTERVAL  # seconds between heartbeats
    heartbeat_ttl: float = keys.HEARTBEAT_TTL  # seconds a heartbeat stays valid
    until_version: int | None = None  # stop training at this version (keep serving)
    adversary: str | None = None  # play an attacker: demos and tests only
    no_train: bool = False  # membership only (no state, no learner)

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> JoinConfig:
        """``join``'s options by name (None: not given) resolved into a config: each name of
        :data:`SETTINGS` from its flag, else ``P2PDILOCO_<NAME>``, else the config file, else
        its default, cast to its type; the bootstrap list likewise (``bootstrap_addrs``).

        Raises ConfigError naming the setting for a value that cannot be (a bad cast, a bad
        ``--gpus`` list, ``--lan-island`` without ``--island``, a share outside (0, 1], a
        batch size under 1, neither ``--model`` nor ``--run``, a malformed bootstrap address),
        ModelError (with a "did you mean") for an unknown ``--model``, UserError when no
        bootstrap server is configured at all; checked in that order."""
        conf = load_config_file()
        got = {
            name: _typed(name, flags.get(name), default, cast, conf)
            for name, (cast, default) in SETTINGS.items()
        }
        got["gpus"] = _gpus(got["gpus"])
        try:
            secret = got["island_secret"]
            got["island_secret"] = parse_secret(secret) if secret else None
        except ValueError as e:
            raise ConfigError(f"--island-secret: {e}") from None
        if flags.get("lan_island") and not flags.get("island"):
            raise ConfigError("--lan-island needs --island NAME, the same on every host of the LAN")
        if not 0.0 < got["compute_share"] <= 1.0:
            raise ConfigError(f"--compute-share must be in (0, 1], not {got['compute_share']}")
        if not got["model"] and not got["run"]:
            raise ConfigError("pass --model NAME (the most active run of it) or --run ID")
        if got["batch_size"] is not None and got["batch_size"] < 1:
            raise ConfigError("--batch-size must be at least 1")
        if got["model"]:  # before the DHT starts: a typo is refused in a moment, with the fix
            get_spec(got["model"])
        # Before anything heavy is imported: a missing or mistyped address fails at once.
        addrs, source = bootstrap_addrs(flags.get("bootstrap"))
        given = {f.name: flags[f.name] for f in fields(cls) if flags.get(f.name) is not None}
        given["announce"] = tuple(given.get("announce", ()))
        return cls(**{**given, **got, "bootstrap": tuple(addrs), "bootstrap_source": source})

    def node_config(self) -> NodeConfig:
        """The node's own settings (``node.NodeConfig``): where to listen, whom to dial."""
        from p2pdiloco.net.known_peers import known_peers_path
        from p2pdiloco.net.local_runs import manifest_paths
        from p2pdiloco.node import NodeConfig
        from p2pdiloco.protocol.identity import default_identity_path

        return NodeConfig(
            bootstrap=list(self.bootstrap),
            model=self.model,
            run=self.run,
            identity=self.identity,
            known_peers=known_peers_path(self.identity or default_identity_path()),
            host=self.host,
            port=self.port,
            announce=list(self.announce),
            island=self.island or "",
            gossip=not self.no_gossip,
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_ttl=self.heartbeat_ttl,
            # The run's manifest kept in --state-dir, else in the default state directories.
            local_manifests=tuple(manifest_paths(self.state_dir, default_identity_path().parent)),
        )

    def preflight_config(self, device: str, gpus: tuple[int, ...]) -> PreflightConfig:
        """What the local preflight checks, on the device and GPUs this node will use."""
        from p2pdiloco.preflight import PreflightConfig

        return PreflightConfig(
            model=self.model,
            device=device,
            gpus=gpus,
            max_memory_gb=self.max_memory,
            batch_size=self.batch_size,
            state_dir=self.state_dir,
        )

    def train_config(
        self, state_dir: Path, device: str, micro_batch: int, island: IslandSpec | None
    ) -> TrainConfig:
        """How this node trains (``runtime.launch.TrainConfig``), once the run is known."""
        from p2pdiloco.runtime.launch import TrainConfig

        return TrainConfig(
            state_dir=state_dir,
            device=device,
            threads=self.threads,
            until_version=self.until_version,
            attack=self.adversary,
            micro_batch=micro_batch,
            compute_share=self.compute_share,
            island=island,
        )


def _typed(name: str, flag: Any, default: Any, cast: Any, config: dict[str, Any]) -> Any:
    """flags > env P2PDILOCO_<NAME> > config file > default, cast to the option's type."""
    value = resolve(name, flag, default, config=config)
    if value is None or value == default:
        return value
    try:
        return cast(value)
    except (TypeError, ValueError):
        raise ConfigError(f"setting '{name}' has an invalid value {value!r}") from None


def _gpus(value: str | None) -> tuple[int, ...]:
    if not value:
        return ()
    try:
        ids = tuple(int(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--gpus takes indices like 0,2, not {value!r}") from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ConfigError(f"--gpus takes distinct non-negative indices like 0,2, not {value!r}")
    return ids
