"""``p2pdiloco bootstrap``: run a community bootstrap server until Ctrl-C or SIGTERM."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from p2pdiloco.cli.common import user_errors
from p2pdiloco.net.bootstrap_config import BootstrapConfig
from p2pdiloco.signals import Interrupted, stop_event

_d = BootstrapConfig()


@user_errors
def bootstrap(
    host: Annotated[str, typer.Option(help="Interface for the DHT and gossip hosts.")] = _d.host,
    port: Annotated[int, typer.Option(help="DHT TCP port; gossip uses port+1.")] = _d.port,
    http_host: Annotated[str, typer.Option(help="Interface for HTTP.")] = _d.http_host,
    http_port: Annotated[
        int, typer.Option(help="/healthz, /api/v1/state, /metrics.")
    ] = _d.http_port,
    announce: Annotated[
        list[str] | None, typer.Option(help="Public multiaddr to advertise (repeatable).")
    ] = None,
    identity: Annotated[
        Path | None,
        typer.Option(help="Key file [default: ~/.local/share/p2pdiloco/bootstrap.key]."),
    ] = None,
    peer: Annotated[
        list[str] | None, typer.Option(help="Another bootstrap's multiaddr to peer with.")
    ] = None,
) -> None:
    """Run a public entry point: DHT node with relay, gossip host, health and metrics."""
    from p2pdiloco.cli.net_common import check_multiaddrs
    from p2pdiloco.net.ports import check_ports

    check_multiaddrs(peer or [], "--peer")
    check_ports(
        [
            (host, port, "DHT", "--port"),
            (host, port + 1 if port else 0, "gossip host (--port + 1)", "--port"),
            (http_host, http_port, "HTTP API", "--http-port"),
        ]
    )
    from p2pdiloco.net.bootstrap import BootstrapServer  # hivemind, torch: after the checks

    stop = stop_event()
    cfg = BootstrapConfig(
        host=host,
        port=port,
        http_host=http_host,
        http_port=http_port,
        announce=announce or [],
        identity=identity,
        initial_peers=peer or [],
    )
    server = BootstrapServer(cfg)
    try:
        with stop.interrupting():  # Ctrl-C while starting: close what started, at once
            server.start()
        assert server.http is not None
        print(f"p2pdiloco bootstrap {server.identity.peer_id}", flush=True)
        print("DHT multiaddrs (give one to nodes with --bootstrap):", flush=True)
        for addr in server.multiaddrs():
            print(f"  {addr}", flush=True)
        if server.gossip is not None:
            for addr in server.gossip.maddrs:
                print(f"gossip: {addr}", flush=True)
        web = f"http://{http_host}:{server.http.port}"
        print(f"web page: {web}/  (runs, peers, the verified leaderboard)", flush=True)
        print(f"HTTP: {web}/healthz  {web}/api/v1/state  {web}/metrics", flush=True)
        stop.wait()
        print("stopping", flush=True)
    except Interrupted:
        print("stopping (interrupted while starting)", flush=True)
    finally:
        server.close()
