"""``p2pdiloco join``: join a run, publish heartbeats, serve until stopped."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from p2pdiloco.cli.common import user_errors
from p2pdiloco.cli.net_common import bootstrap_addrs
from p2pdiloco.cli.signals import stop_event
from p2pdiloco.errors import ConfigError
from p2pdiloco.net import keys
from p2pdiloco.node import Node, NodeConfig
from p2pdiloco.train.device import resolve_device
from p2pdiloco.train.memory import check_fits

log = logging.getLogger("p2pdiloco.join")


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
    port: Annotated[int, typer.Option(help="DHT TCP port (gossip: port+1); 0 = random.")] = 0,
    announce: Annotated[
        list[str] | None, typer.Option(help="Public multiaddr to advertise.")
    ] = None,
    island: Annotated[str | None, typer.Option(help="Island name [default: host name].")] = None,
    no_tui: Annotated[
        bool, typer.Option("--no-tui", help="Plain log lines instead of the dashboard.")
    ] = False,
    no_gossip: Annotated[bool, typer.Option("--no-gossip", help="DHT polling only.")] = False,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda[:N], mps or xla.")] = "auto",
    heartbeat_interval: Annotated[
        float, typer.Option(help="Seconds between heartbeats.", hidden=True)
    ] = keys.HEARTBEAT_INTERVAL,
    heartbeat_ttl: Annotated[
        float, typer.Option(help="Seconds a heartbeat stays valid.", hidden=True)
    ] = keys.HEARTBEAT_TTL,
) -> None:
    """Join a training run through the bootstrap servers and serve until Ctrl-C."""
    if not model and not run:
        raise ConfigError("pass --model NAME (the most active run of it) or --run ID")
    if model:  # refuse before any network or allocation work, with what would fit instead
        dev = resolve_device(device)
        check_fits(model, dev, "bf16-mixed" if dev.type in ("cuda", "xla") else "fp32")
    stop = stop_event()
    addrs, source = bootstrap_addrs(bootstrap)
    log.info("bootstrap servers from %s: %s", source, ", ".join(addrs))
    node = Node(
        NodeConfig(
            bootstrap=addrs,
            model=model,
            run=run,
            identity=identity,
            host=host,
            port=port,
            announce=announce or [],
            island=island or "",
            gossip=not no_gossip,
            heartbeat_interval=heartbeat_interval,
            heartbeat_ttl=heartbeat_ttl,
        )
    )
    try:
        node.start()
        snap = node.snapshot()
        print(
            f"joined run {snap['run_name']} ({snap['run_id'][:12]}) as {snap['peer_id']}",
            flush=True,
        )
        print(f"reachability: {node.reachability.status}: {node.reachability.detail}", flush=True)
        if node.reachability.fix:
            print(f"fix: {node.reachability.fix}", flush=True)
        while not stop.wait(heartbeat_interval):
            snap = node.snapshot()
            log.info(
                "peers %d (%s), gossip %s, rejected records %d",
                len(snap["peers"]),
                ", ".join(p["peer_id"][-8:] for p in snap["peers"]),
                "on" if snap["gossip"] else "off",
                snap["rejected"],
            )
        print("stopping: nothing to save yet (no training state at this stage)", flush=True)
    finally:
        node.close()
