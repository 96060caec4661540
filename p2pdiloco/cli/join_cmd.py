"""``p2pdiloco join``: preflight, join a run, train in it, show the dashboard, stop cleanly."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from p2pdiloco.choices import ATTACKS
from p2pdiloco.cli.common import user_errors
from p2pdiloco.cli.join_logs import json_logging, log_to_file
from p2pdiloco.cli.net_common import bootstrap_addrs
from p2pdiloco.cli.signals import stop_event
from p2pdiloco.config import load_config_file, resolve
from p2pdiloco.errors import ConfigError, UserError
from p2pdiloco.island.secret import new_secret, parse_secret
from p2pdiloco.island.spec import IslandSpec, default_gpus, lan_host
from p2pdiloco.island.spec import island_spec as spec_from_flags
from p2pdiloco.net import keys
from p2pdiloco.protocol.identity import default_identity_path

if TYPE_CHECKING:  # hivemind, torch: imported once the settings and addresses are known good
    from p2pdiloco.node import Node

log = logging.getLogger("p2pdiloco.join")
GiB = 2**30


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


@user_errors
def join(
    model: Annotated[
        str | None, typer.Option(help="Join the most active run of this model.")
    ] = None,
    run: Annotated[str | None, typer.Option(help="Join this run id (or a unique prefix).")] = None,
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Bootstrap multiaddr (repeatable).")
    ] = None,
    identity: Annotated[
        Path | None, typer.Option(help="Key file [default: XDG data path].")
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "0.0.0.0",
    port: Annotated[
        int | None, typer.Option(help="DHT TCP port (gossip: port+1); 0 = random.")
    ] = None,
    announce: Annotated[
        list[str] | None, typer.Option(help="Public multiaddr to advertise.")
    ] = None,
    island: Annotated[str | None, typer.Option(help="Island name [default: host name].")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda[:N], mps or xla.")] = None,
    gpus: Annotated[
        str | None,
        typer.Option(help="CUDA devices, e.g. 0,2: several form an island, one rank per GPU."),
    ] = None,
    island_ranks: Annotated[
        int | None,
        typer.Option(help="Processes that train this node's learner together (CPU: gloo)."),
    ] = None,
    offload: Annotated[
        bool,
        typer.Option(
            "--offload", help="Keep a CUDA island's optimizer state and weights in host RAM."
        ),
    ] = False,
    lan_island: Annotated[
        bool,
        typer.Option(
            "--lan-island", help="Form or join the LAN island named by --island (first host leads)."
        ),
    ] = False,
    island_secret: Annotated[
        str | None,
        typer.Option(
            help="A LAN island's secret (64 hex digits, printed by its leader): members need it."
        ),
    ] = None,
    max_memory: Annotated[
        float | None, typer.Option(help="GiB this node may use [default: what is free].")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="Sequences per micro-batch [default: auto, printed].")
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Hugging Face cache for tokenizers and weights.")
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Certified states and receipts [default: XDG data path / run id]."),
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads for torch [default: torch's choice].")
    ] = None,
    compute_share: Annotated[
        float | None,
        typer.Option(help="Share of time to train, in (0, 1]: pauses keep the machine usable."),
    ] = None,
    no_tui: Annotated[
        bool, typer.Option("--no-tui", help="Plain log lines instead of the dashboard.")
    ] = False,
    json_logs: Annotated[
        bool, typer.Option("--json-logs", help="One JSON object per log line.")
    ] = False,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus /metrics on this port.")
    ] = None,
    no_gossip: Annotated[bool, typer.Option("--no-gossip", help="DHT polling only.")] = False,
    heartbeat_interval: Annotated[
        float, typer.Option(help="Seconds between heartbeats.", hidden=True)
    ] = keys.HEARTBEAT_INTERVAL,
    heartbeat_ttl: Annotated[
        float, typer.Option(help="Seconds a heartbeat stays valid.", hidden=True)
    ] = keys.HEARTBEAT_TTL,
    until_version: Annotated[
        int | None,
        typer.Option(help="Stop training at this global version (keep serving).", hidden=True),
    ] = None,
    adversary: Annotated[
        str | None,
        typer.Option(help="Play an attacker (sign-flip, scale, ...): demos only.", hidden=True),
    ] = None,
    no_train: Annotated[
        bool, typer.Option("--no-train", help="Membership only (no training).", hidden=True)
    ] = False,
) -> None:
    """Join a training run through the bootstrap servers and train until Ctrl-C.

    Settings come from flags, then P2PDILOCO_<NAME> variables, then
    ~/.config/p2pdiloco/config.toml, then defaults. The first Ctrl-C stops cleanly (saves and
    says what was kept); a second one exits at once.
    """
    conf = load_config_file()
    model = _typed("model", model, None, str, conf)
    run = _typed("run", run, None, str, conf)
    identity = _typed("identity", identity, None, Path, conf)
    port = _typed("port", port, 0, int, conf)
    dev_name = _typed("device", device, "auto", str, conf)
    gpu_ids = _gpus(_typed("gpus", gpus, None, str, conf))
    ranks = _typed("island_ranks", island_ranks, None, int, conf)
    if lan_island and not island:
        raise ConfigError("--lan-island needs --island NAME, the same on every host of the LAN")
    secret_hex = _typed("island_secret", island_secret, None, str, conf)
    try:
        secret = parse_secret(secret_hex) if secret_hex else None
    except ValueError as e:
        raise ConfigError(f"--island-secret: {e}") from None
    max_mem = _typed("max_memory", max_memory, None, float, conf)
    micro = _typed("batch_size", batch_size, None, int, conf)
    cache = _typed("cache_dir", cache_dir, None, Path, conf)
    state = _typed("state_dir", state_dir, None, Path, conf)
    mport = _typed("metrics_port", metrics_port, None, int, conf)
    share = _typed("compute_share", compute_share, 1.0, float, conf)
    if not 0.0 < share <= 1.0:
        raise ConfigError(f"--compute-share must be in (0, 1], not {share}")
    if not model and not run:
        raise ConfigError("pass --model NAME (the most active run of it) or --run ID")
    if micro is not None and micro < 1:
        raise ConfigError("--batch-size must be at least 1")
    # Before anything heavy is imported: a missing or mistyped address fails at once.
    addrs, source = bootstrap_addrs(bootstrap)
    if not gpu_ids and ranks is None and dev_name in ("auto", "cuda"):
        gpu_ids = default_gpus()  # every visible GPU, as one island
    island_spec = spec_from_flags(
        dev_name, gpu_ids, ranks, threads,
        lan=lan_island, host=lan_host(host) if lan_island else "127.0.0.1", offload=offload,
    )  # fmt: skip
    if island_spec is not None and island_spec.lan:  # other hosts must be told the secret
        island_spec = replace(island_spec, secret=secret or new_secret())
    if gpu_ids:
        dev_name = f"cuda:{gpu_ids[0]}"
    if cache is not None:
        os.environ["HF_HOME"] = str(cache)  # read by transformers when tokenizers load
    if json_logs:
        json_logging()
    if model:  # refuse before any network or allocation work, with what would fit instead
        from p2pdiloco.train.device import resolve_device
        from p2pdiloco.train.memory import check_fits

        dev = resolve_device(dev_name)
        available = int(max_mem * GiB) if max_mem else None
        if island_spec is not None:
            from p2pdiloco.cli.join_island import plan_island_for

            island_spec = plan_island_for(model, island_spec, available)
        else:
            precision = "bf16-mixed" if dev.type in ("cuda", "xla") else "fp32"
            check_fits(model, dev, precision, available=available)
    _preflight(model, dev_name, gpu_ids, max_mem, micro, state)
    _check_ports(host, port, mport, not no_gossip)
    stop = stop_event()
    log.info("bootstrap servers from %s: %s", source, ", ".join(addrs))
    from p2pdiloco.net.known_peers import known_peers_path
    from p2pdiloco.node import Node, NodeConfig

    node = Node(
        NodeConfig(
            bootstrap=addrs,
            model=model,
            run=run,
            identity=identity,
            known_peers=known_peers_path(identity or default_identity_path()),
            host=host,
            port=port,
            announce=announce or [],
            island=island or "",
            gossip=not no_gossip,
            heartbeat_interval=heartbeat_interval,
            heartbeat_ttl=heartbeat_ttl,
        )
    )
    running = None
    metrics_api = None
    announcer: Any = None
    try:
        node.start()
        snap: dict[str, Any] = dict(node.snapshot())
        print(
            f"joined run {snap['run_name']} ({snap['run_id'][:12]}) as {snap['peer_id']}",
            flush=True,
        )
        print(f"reachability: {node.reachability.status}: {node.reachability.detail}", flush=True)
        if node.reachability.fix:
            print(f"fix: {node.reachability.fix}", flush=True)
        _network_findings(node)
        if lan_island:
            from p2pdiloco.cli.join_island import serve_lan_member
            from p2pdiloco.island.lan import Announcer, find_leader

            if (leader := find_leader(node, node.island)) is not None:
                if secret is None:
                    raise UserError(
                        f"island {node.island} is led by {leader.peer_id[:16]}; its members "
                        "need its secret: pass --island-secret (its leader printed it)"
                    )
                serve_lan_member(node, leader, secret, dev_name, stop)
                return
        running = _start_node(
            node, dev_name, micro, max_mem, state, threads, until_version, adversary, no_train,
            share, island_spec,
        )  # fmt: skip
        from p2pdiloco.node_view import NodeView

        view = NodeView(node, running if not no_train else None)
        if mport is not None:
            from p2pdiloco.node_metrics import serve_metrics

            try:
                metrics_api = serve_metrics(host, mport, view.metrics, lambda: True)
            except OSError as e:  # taken since the check before joining
                raise UserError(
                    f"cannot listen on {host}:{mport} for the metrics server: "
                    f"{e.strerror or e}; pass another --metrics-port"
                ) from None
            print(f"metrics: http://{host}:{metrics_api.port}/metrics", flush=True)
        tui = sys.stdout.isatty() and not no_tui and not json_logs
        if lan_island and running.trainer is not None:
            announcer = Announcer(node, node.island, running.trainer.learner)
            announcer.start()
            print(f"island {node.island}: leading; members join at {announcer.address}", flush=True)
            assert island_spec is not None and island_spec.secret is not None
            print(
                f"island {node.island}: other hosts join with --island {node.island} --lan-island "
                f"--island-secret {island_spec.secret.hex()}",
                flush=True,
            )
        _serve(view, running if not no_train else None, stop, tui, json_logs, heartbeat_interval)
        if announcer is not None:
            announcer.stop()
        kept = running.stop()
        error, running = running.error, None
        if no_train:
            print("stopped", flush=True)
        else:
            print(f"stopped {'cleanly' if not error else 'on an error'}; kept {kept}", flush=True)
        if error:
            raise UserError(f"training stopped: {error}")
    finally:
        if running is not None:
            running.stop()
        if metrics_api is not None:
            metrics_api.close()
        node.close()


def _preflight(
    model: str | None,
    device: str,
    gpus: tuple[int, ...],
    max_mem: float | None,
    micro: int | None,
    state: Path | None,
) -> None:
    """The rest of the preflight (memory was checked above): warnings printed, errors fatal.
    Without a model (``--run`` only) the disk is checked again once the run's model is known."""
    from p2pdiloco.preflight import (
        PreflightConfig,
        check_disk,
        check_python,
        check_torch,
    )

    cfg = PreflightConfig(
        model=model, device=device, gpus=gpus, max_memory_gb=max_mem, batch_size=micro,
        state_dir=state,
    )  # fmt: skip
    findings = [check_python(), *check_torch(), check_disk(cfg)]
    errors = [f for f in findings if f.severity == "error"]
    for f in findings:
        if f.severity == "warn":
            log.warning("preflight %s: %s (fix: %s)", f.check, f.detail, f.fix)
    if errors:
        f = errors[0]
        raise UserError(f"{f.check}: {f.detail}; fix: {f.fix}")


def _check_ports(host: str, port: int, metrics_port: int | None, gossip: bool) -> None:
    """Every fixed port this node will listen on is free: refused now, not after joining."""
    from p2pdiloco.net.ports import check_ports

    check_ports(
        [
            (host, port, "DHT", "--port"),
            (host, port + 1 if port and gossip else 0, "gossip host (--port + 1)", "--port"),
            (host, metrics_port or 0, "metrics server", "--metrics-port"),
        ]
    )


def _refuse_disk(model: str, state_dir: Path) -> None:
    """The run's state directory is writable with room for the run model's checkpoints."""
    from p2pdiloco.preflight import PreflightConfig, check_disk

    f = check_disk(PreflightConfig(model=model, state_dir=state_dir))
    if f.severity == "error":
        raise UserError(f"{f.check}: {f.detail}; fix: {f.fix}")


def _network_findings(node: Node) -> None:
    """Preflight checks that need the network: clock skew against the bootstrap servers'
    signed heartbeats (they refresh every few seconds, so their timestamps trail ours by at
    most an interval when clocks agree)."""
    from statistics import median

    from p2pdiloco.net.discovery import read_bootstraps
    from p2pdiloco.preflight import check_clock

    assert node.dht is not None
    try:
        views = list(read_bootstraps(node.dht).peers.values())
    except Exception as e:  # the check is advisory; the node works without it
        log.info("clock check skipped: %s", e)
        return
    if not views:
        return
    now = time.time()
    offset = median(v.ts - now for v in views)
    # A fresh heartbeat is up to one interval old: only what lies beyond that is skew.
    skew = offset if offset > 0 else min(0.0, offset + keys.HEARTBEAT_INTERVAL)
    finding = check_clock(skew)
    line = f"clock: {finding.severity}: {finding.detail}"
    if finding.fix:
        line += f"; fix: {finding.fix}"
    print(line, flush=True)


def _start_node(
    node: Node,
    device: str,
    micro: int | None,
    max_mem: float | None,
    state: Path | None,
    threads: int | None,
    until_version: int | None,
    adversary: str | None,
    no_train: bool,
    compute_share: float = 1.0,
    island: IslandSpec | None = None,
) -> Any:
    from p2pdiloco.preflight import auto_batch_size
    from p2pdiloco.runtime.launch import RunningNode, TrainConfig

    assert node.run is not None
    if no_train:
        running = RunningNode(node, TrainConfig(state_dir=Path("."), train=False))
        running.start()
        return running
    if adversary is not None and adversary not in ATTACKS:
        raise ConfigError(f"unknown attack '{adversary}'; one of {', '.join(ATTACKS)}")
    manifest = node.run.manifest
    state = state or default_state_dir(node.run.run_id)
    _refuse_disk(manifest.model, state)
    step_batch = manifest.inner.batch_size
    if micro is None:
        from p2pdiloco.train.device import resolve_device
        from p2pdiloco.train.memory import available_memory

        dev = resolve_device(device)

        have = int(max_mem * GiB) if max_mem else available_memory(dev)[0]
        micro = auto_batch_size(manifest.model, dev, have)
        how = "auto"
    else:
        how = "--batch-size"
    micro = max(d for d in range(1, step_batch + 1) if step_batch % d == 0 and d <= micro)
    ranks = f" over {island.ranks} island ranks" if island is not None else ""
    print(
        f"batch: {micro} sequences per micro-batch ({how}), {step_batch // micro} accumulation "
        f"steps per inner step of {step_batch} × {manifest.inner.seq_len} tokens{ranks}",
        flush=True,
    )
    running = RunningNode(
        node,
        TrainConfig(
            state_dir=state,
            device=device,
            threads=threads,
            until_version=until_version,
            attack=adversary,
            micro_batch=micro,
            compute_share=compute_share,
            island=island,
        ),
    )
    version = running.start()
    print(f"training from version {version}", flush=True)
    return running


def _serve(view: Any, running: Any, stop: Any, tui: bool, json_logs: bool, interval: float) -> None:
    """Until Ctrl-C (or a fatal training error): the dashboard at 4 Hz, or a log line per
    interval (plain or JSON)."""
    from p2pdiloco.dashboard.layout import short_peer_id
    from p2pdiloco.dashboard.live import json_line, plain_line, render

    def failed() -> bool:
        return running is not None and running.error is not None

    if tui:
        from rich.live import Live

        log_file = (running.cfg.state_dir if running else Path(".")) / "join.log"
        log_to_file(log_file)
        with Live(render(view.snapshot()), refresh_per_second=4, screen=False) as live:
            while not stop.wait(0.25) and not failed():
                live.update(render(view.snapshot()))
        return
    next_line = 0.0
    while not stop.wait(0.5) and not failed():
        if time.monotonic() >= next_line:
            snap = view.snapshot()
            if json_logs:
                print(json_line(snap), flush=True)
            else:
                ns = view.node.snapshot()
                log.info(
                    "peers %d (%s), gossip %s, rejected records %d",
                    len(ns["peers"]),
                    ", ".join(short_peer_id(p["peer_id"]) for p in ns["peers"]),
                    "on" if ns["gossip"] else "off",
                    ns["rejected"],
                )
                if running is not None:
                    log.info(plain_line(snap))
            next_line = time.monotonic() + interval


def default_state_dir(run_id: str) -> Path:
    """``$XDG_DATA_HOME/p2pdiloco/runs/<run id prefix>``, else under ``~/.local/share``."""
    return default_identity_path().parent / "runs" / run_id[:16]
