"""``p2pdiloco join``: join a run and train in it (learner, and syncer when elected)."""

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
from p2pdiloco.participant import Participant, TrainConfig
from p2pdiloco.protocol.identity import default_identity_path
from p2pdiloco.sync.attacks import ATTACKS
from p2pdiloco.sync.service import SyncSettings
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
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Certified states and receipts [default: XDG data path / run id]."),
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads for torch [default: torch's choice].")
    ] = None,
    until_version: Annotated[
        int | None,
        typer.Option(help="Stop training at this global version (keep serving).", hidden=True),
    ] = None,
    adversary: Annotated[
        str | None,
        typer.Option(help="Play an attacker (sign-flip, scale, ...): demos only.", hidden=True),
    ] = None,
    round_grace: Annotated[
        float, typer.Option(help="Seconds a syncer round collects at most.", hidden=True)
    ] = 60.0,
    agree_timeout: Annotated[
        float, typer.Option(help="Seconds before the next leader proposes.", hidden=True)
    ] = 20.0,
    no_train: Annotated[
        bool, typer.Option("--no-train", help="Membership only (no training).", hidden=True)
    ] = False,
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
    participant: Participant | None = None
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
        if not no_train:
            assert node.run is not None
            if adversary is not None and adversary not in ATTACKS:
                raise ConfigError(f"unknown attack '{adversary}'; one of {', '.join(ATTACKS)}")
            participant = Participant(
                node,
                TrainConfig(
                    state_dir=state_dir or default_state_dir(node.run.run_id),
                    device=device,
                    threads=threads,
                    until_version=until_version,
                    attack=adversary,
                    sync=SyncSettings(grace=round_grace, agree_timeout=agree_timeout),
                ),
            )
            participant.start()
            print(f"training from version {participant.state.version}", flush=True)
        while not stop.wait(heartbeat_interval):
            snap = node.snapshot()
            line = (
                f"peers {len(snap['peers'])} "
                f"({', '.join(p['peer_id'][-8:] for p in snap['peers'])}), "
                f"gossip {'on' if snap['gossip'] else 'off'}, rejected records {snap['rejected']}"
            )
            if participant is not None:
                ps = participant.snapshot()
                line += (
                    f"; {ps['phase']}, version {ps['version']}, deltas sent {ps['sent']} "
                    f"accepted {ps['accepted']} rejected {ps['rejected']}"
                )
            log.info(line)
        if participant is not None:
            participant.stop()
            print(
                f"stopped at certified version {participant.state.version} "
                f"(saved under {participant.cfg.state_dir})",
                flush=True,
            )
        else:
            print("stopped", flush=True)
    finally:
        if participant is not None and participant.alive:
            participant.stop()
        node.close()


def default_state_dir(run_id: str) -> Path:
    """``$XDG_DATA_HOME/p2pdiloco/runs/<run id prefix>``, else under ``~/.local/share``."""
    return default_identity_path().parent / "runs" / run_id[:16]
