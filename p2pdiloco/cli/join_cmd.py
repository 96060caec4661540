"""``p2pdiloco join``: preflight, join a run, train in it, show the dashboard, stop cleanly."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from p2pdiloco.choices import ATTACKS
from p2pdiloco.cli.common import user_errors
from p2pdiloco.cli.join_config import JoinConfig
from p2pdiloco.cli.join_logs import json_logging, log_to_file
from p2pdiloco.errors import ConfigError, UserError
from p2pdiloco.island.secret import new_secret
from p2pdiloco.island.spec import IslandSpec, default_gpus, lan_host
from p2pdiloco.island.spec import island_spec as spec_from_flags
from p2pdiloco.net import keys
from p2pdiloco.protocol.identity import default_identity_path
from p2pdiloco.signals import Interrupted, Stop, stop_event

if TYPE_CHECKING:  # hivemind, torch: imported once the settings and addresses are known good
    from p2pdiloco.node import Node
    from p2pdiloco.preflight import PreflightConfig

log = logging.getLogger("p2pdiloco.join")
GiB = 2**30


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
    island: Annotated[
        str | None, typer.Option(help="Island name [default: island-<end of peer id>].")
    ] = None,
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
    run_join(JoinConfig.from_flags(locals()))  # the options are JoinConfig's fields, by name


def run_join(cfg: JoinConfig) -> None:
    """Assemble a node from ``cfg`` and run it until Ctrl-C or a fatal error: refuse what
    cannot work before any network or allocation (placement, memory, preflight, ports), join
    the run (``node.Node``), serve another host's LAN island or start training
    (``runtime.launch.RunningNode``), show it (``node_view.NodeView``: dashboard, log lines,
    metrics), then stop cleanly and say what was kept. UserError (exit 2) for what the user
    can fix; the node is closed whatever happens.

    Ctrl-C (or SIGTERM) is honoured at any moment: while starting it interrupts the step under
    way (``signals.Interrupted``), what was started is closed, and the command ends (exit 0)
    saying so; a second Ctrl-C exits at once (130)."""
    stop = stop_event()
    try:
        _join(cfg, stop)
    except Interrupted:
        print("stopped cleanly (interrupted while starting)", flush=True)


def _join(cfg: JoinConfig, stop: Stop) -> None:
    with stop.interrupting():
        # A taken port first, before anything starts; the bootstrap servers are probed
        # meanwhile (seconds at most) while this machine is checked, and their answer awaited
        # after.
        _check_ports(cfg.host, cfg.port, cfg.metrics_port, not cfg.no_gossip)
        probe = _probe_bootstrap(cfg)
        device, gpus, island = _placement(cfg)
        if cfg.cache_dir is not None:
            os.environ["HF_HOME"] = str(cfg.cache_dir)  # read by transformers for tokenizers
        if cfg.json_logs:
            json_logging()
        if cfg.model:  # refuse before any network or allocation work, with what would fit
            island = _refuse_what_does_not_fit(cfg.model, device, island, cfg.max_memory)
        _preflight(cfg.preflight_config(device, gpus))
        probe.result()
    log.info("bootstrap servers from %s: %s", cfg.bootstrap_source, ", ".join(cfg.bootstrap))
    from p2pdiloco.node import Node

    node = Node(cfg.node_config())
    running, metrics_api, announcer = None, None, None
    try:
        with stop.interrupting():
            node.start()
            _say_joined(node)
        if cfg.lan_island and _serve_a_lan_island(node, cfg.island_secret, device, stop):
            return
        with stop.interrupting():
            running = _start_training(node, cfg, device, island)
        training = None if cfg.no_train else running  # what the view and the loop show
        from p2pdiloco.runtime.node_view import NodeView

        view = NodeView(node, training)
        if cfg.metrics_port is not None:
            metrics_api = _serve_metrics(view, cfg.host, cfg.metrics_port)
        if cfg.lan_island and running.trainer is not None and island is not None:
            announcer = _lead_lan_island(node, running, island)
        tui = sys.stdout.isatty() and not cfg.no_tui and not cfg.json_logs
        _serve(view, training, stop, tui, cfg.json_logs, cfg.heartbeat_interval)
        if announcer is not None:
            announcer.stop()
        kept = running.stop()
        error, running = running.error, None
        if cfg.no_train:
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


def _placement(cfg: JoinConfig) -> tuple[str, tuple[int, ...], IslandSpec | None]:
    """The device rank 0 trains on, the GPUs used, and the island formed (None: one process).
    Without ``--gpus`` or ``--island-ranks`` on ``auto`` or ``cuda``, every visible GPU forms
    one island. ConfigError for a combination that cannot be (``island.spec.island_spec``)."""
    gpus = cfg.gpus
    if not gpus and cfg.island_ranks is None and cfg.device in ("auto", "cuda"):
        gpus = default_gpus()
    host = lan_host(cfg.host) if cfg.lan_island else "127.0.0.1"
    island = spec_from_flags(
        cfg.device,
        gpus,
        cfg.island_ranks,
        cfg.threads,
        lan=cfg.lan_island,
        host=host,
        offload=cfg.offload,
    )
    if island is not None and island.lan:  # its other hosts are told the secret
        island = replace(island, secret=cfg.island_secret or new_secret())
    return (f"cuda:{gpus[0]}" if gpus else cfg.device), gpus, island


def _refuse_what_does_not_fit(
    model: str, device: str, island: IslandSpec | None, max_memory: float | None
) -> IslandSpec | None:
    """ModelTooLarge (one line, with what would fit) if ``model`` cannot train here; an
    island's spec comes back following the plan printed for it."""
    from p2pdiloco.train.device import resolve_device
    from p2pdiloco.train.memory import check_fits

    dev = resolve_device(device)
    available = int(max_memory * GiB) if max_memory else None
    if island is not None:
        from p2pdiloco.cli.join_island import plan_island_for

        return plan_island_for(model, island, available)
    precision = "bf16-mixed" if dev.type in ("cuda", "xla") else "fp32"
    check_fits(model, dev, precision, available=available)
    return None


def _say_joined(node: Node) -> None:
    """The lines a volunteer sees once the node has joined: the run, reachability (with the
    fix when relayed), then the checks that need the network."""
    snap: dict[str, Any] = dict(node.snapshot())
    if node.run_note:
        print(node.run_note, flush=True)
    print(f"joined run {snap['run_name']} ({snap['run_id'][:12]}) as {snap['peer_id']}", flush=True)
    print(f"reachability: {node.reachability.status}: {node.reachability.detail}", flush=True)
    if node.reachability.fix:
        print(f"fix: {node.reachability.fix}", flush=True)
    _network_findings(node)


def _serve_a_lan_island(node: Node, secret: bytes | None, device: str, stop: Any) -> bool:
    """With ``--lan-island``: if another host already leads the island, serve it as a member
    until it stops or Ctrl-C, and return True; False if this host is to lead it. UserError
    (one line) when it is led elsewhere and ``secret`` was not given."""
    from p2pdiloco.cli.join_island import serve_lan_member
    from p2pdiloco.island.lan import find_leader

    if (leader := find_leader(node, node.island)) is None:
        return False
    if secret is None:
        raise UserError(
            f"island {node.island} is led by {leader.peer_id[:16]}; its members need its "
            "secret: pass --island-secret (its leader printed it)"
        )
    serve_lan_member(node, leader, secret, device, stop)
    return True


def _lead_lan_island(node: Node, running: Any, island: IslandSpec) -> Any:
    """This host leads its LAN island: announce where members join, and say how."""
    from p2pdiloco.island.lan import Announcer

    announcer = Announcer(node, node.island, running.trainer.learner)
    announcer.start()
    print(f"island {node.island}: leading; members join at {announcer.address}", flush=True)
    assert island.secret is not None
    print(
        f"island {node.island}: other hosts join with --island {node.island} --lan-island "
        f"--island-secret {island.secret.hex()}",
        flush=True,
    )
    return announcer


def _serve_metrics(view: Any, host: str, port: int) -> Any:
    """Prometheus /metrics from the node's view; UserError if the port was taken since the
    check before joining."""
    from p2pdiloco.runtime.node_metrics import serve_metrics

    try:
        metrics_api = serve_metrics(host, port, view.metrics, lambda: True)
    except OSError as e:
        raise UserError(
            f"cannot listen on {host}:{port} for the metrics server: "
            f"{e.strerror or e}; pass another --metrics-port"
        ) from None
    print(f"metrics: http://{host}:{metrics_api.port}/metrics", flush=True)
    return metrics_api


def _preflight(cfg: PreflightConfig) -> None:
    """The rest of the preflight (memory was checked above): warnings printed, errors fatal.
    Without a model (``--run`` only) the disk is checked again once the run's model is known."""
    from p2pdiloco.preflight import check_disk, check_python, check_torch

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


def _probe_bootstrap(cfg: JoinConfig) -> Future[None]:
    """Whether a bootstrap server, or a peer remembered from an earlier run, answers, asked in
    a thread; its result raises BootstrapUnreachable (one line: what was tried, what to check)
    seconds after the start if none does, instead of the DHT daemon's failure after 20."""
    from p2pdiloco.cli.net_common import require_an_answer
    from p2pdiloco.net import known_peers

    path = known_peers.known_peers_path(cfg.identity or default_identity_path())
    remembered = known_peers.initial_peers([], known_peers.load(path, ""))
    done: Future[None] = Future()

    def probe() -> None:
        try:
            require_an_answer(list(cfg.bootstrap), cfg.bootstrap_source, remembered)
        except BaseException as e:  # handed to the main thread, which raises it
            done.set_exception(e)
        else:
            done.set_result(None)

    threading.Thread(target=probe, name="p2pdiloco-bootstrap-probe", daemon=True).start()
    return done


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


def _start_training(node: Node, cfg: JoinConfig, device: str, island: IslandSpec | None) -> Any:
    """The running node (``runtime.launch.RunningNode``) started: membership only with
    ``--no-train``; else the run's state directory checked, the micro-batch chosen and said,
    and training started from the certified version (said too)."""
    from p2pdiloco.preflight import auto_batch_size
    from p2pdiloco.runtime.launch import RunningNode, TrainConfig

    assert node.run is not None
    if cfg.no_train:
        running = RunningNode(node, TrainConfig(state_dir=Path("."), train=False))
        _start(running)
        return running
    if cfg.adversary is not None and cfg.adversary not in ATTACKS:
        raise ConfigError(f"unknown attack '{cfg.adversary}'; one of {', '.join(ATTACKS)}")
    manifest = node.run.manifest
    state = cfg.state_dir or default_state_dir(node.run.run_id)
    _refuse_disk(manifest.model, state)
    step_batch = manifest.inner.batch_size
    micro = cfg.batch_size
    if micro is None:
        from p2pdiloco.train.device import resolve_device
        from p2pdiloco.train.memory import available_memory

        dev = resolve_device(device)
        have = int(cfg.max_memory * GiB) if cfg.max_memory else available_memory(dev)[0]
        micro = auto_batch_size(manifest.model, dev, have)
        how = f"auto: up to {micro} fit"  # what doctor plans; the run's batch may cap it
    else:
        how = f"--batch-size {micro}"
    micro = max(d for d in range(1, step_batch + 1) if step_batch % d == 0 and d <= micro)
    ranks = f" over {island.ranks} island ranks" if island is not None else ""
    print(
        f"batch: {micro} sequences per micro-batch ({how}), {step_batch // micro} accumulation "
        f"steps per inner step of {step_batch} × {manifest.inner.seq_len} tokens{ranks}",
        flush=True,
    )
    running = RunningNode(node, cfg.train_config(state, device, micro, island))
    print(f"training from version {_start(running)}", flush=True)
    return running


def _start(running: Any) -> int:
    """``running.start()``; interrupted (Ctrl-C) or failed, what it started is stopped: its
    runtime's tasks end and the checkpoint writes under way finish (each is atomic)."""
    try:
        return int(running.start())
    except BaseException:
        running.stop()
        raise


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
