"""``p2pdiloco status``: runs and peers as the DHT sees them, or the contribution leaderboard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from p2pdiloco.cli.common import user_errors
from p2pdiloco.cli.net_common import dht_client
from p2pdiloco.dashboard.status import leaderboard_view, status_view
from p2pdiloco.errors import UserError
from p2pdiloco.net.discovery import collect_state


@user_errors
def status(
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Bootstrap multiaddr (repeatable).")
    ] = None,
    leaderboard: Annotated[
        bool,
        typer.Option("--leaderboard", help="Rank peers by verified accepted tokens."),
    ] = False,
    run: Annotated[
        str | None, typer.Option(help="Run id (prefix) for --leaderboard [default: busiest].")
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="--leaderboard from a node's state directory instead of the network."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show runs, peers (direct or relayed), their versions and throughput; or, with
    --leaderboard, every peer's contribution as certified by the committees' receipts."""
    if leaderboard:
        board = (
            _leaderboard_offline(state_dir) if state_dir else _leaderboard_online(bootstrap, run)
        )
        if json_out:
            print(json.dumps(board, indent=2))
        else:
            Console().print(leaderboard_view(board))
        return
    with dht_client(bootstrap) as dht:
        state = collect_state(dht).to_dict()
    if json_out:
        print(json.dumps(state, indent=2))
    else:
        Console().print(status_view(state))


def _leaderboard_offline(state_dir: Path) -> dict[str, Any]:
    """From a node's kept certificates and the signed manifest it saved."""
    from p2pdiloco.ledger import build_ledger
    from p2pdiloco.protocol.records import parse_manifest
    from p2pdiloco.protocol.signing import InvalidRecord, open_envelope

    try:
        env = open_envelope((state_dir / "manifest.json").read_bytes(), kind="manifest")
        run_id, manifest = parse_manifest(env)
    except (OSError, InvalidRecord) as e:
        raise UserError(f"no valid run manifest in {state_dir}: {e}") from None
    raws = [p.read_bytes() for p in sorted((state_dir / "certs").glob("*.json"))]
    return {
        "run_id": run_id,
        "run_name": manifest.name,
        **build_ledger(run_id, manifest, raws).to_dict(),
    }


def _leaderboard_online(bootstrap: list[str] | None, run: str | None) -> dict[str, Any]:
    """Certificates fetched from the run's nodes (any of them may lie: each is verified)."""
    from p2pdiloco.ledger import build_ledger
    from p2pdiloco.net.cert_records import read_certificates
    from p2pdiloco.net.discovery import read_peers, read_runs
    from p2pdiloco.net.p2p_bridge import P2PBridge
    from p2pdiloco.runtime.transport import P2PTransport
    from p2pdiloco.sync.fetch import walk_chain

    with dht_client(bootstrap) as dht:
        runs, _ = read_runs(dht)
        runs = [r for r in runs if not r.incompatible and (run is None or r.run_id.startswith(run))]
        if not runs:
            raise UserError(f"run '{run}' not found in the DHT" if run else "no runs found")
        for r in runs:
            r.peers = read_peers(dht, r.run_id)
        info = max(runs, key=lambda r: len(r.peers.peers) if r.peers else 0)
        raws = read_certificates(dht, info.run_id)
        addrs = (
            {v.peer_id: list(v.heartbeat.addrs) for v in info.peers.peers.values()}
            if info.peers
            else {}
        )
        bridge = P2PBridge(dht.dht)
        transport = P2PTransport(bridge.p2p, dht.peer_id, lambda p: addrs.get(p, []))
        try:  # version by version from genesis: a claimed version counts once its chain verifies
            walk = walk_chain(transport, info.run_id, info.manifest, list(addrs), raws)
            chain = bridge.run(walk, 300)
        finally:
            bridge.close()
    ledger = build_ledger(info.run_id, info.manifest, [c.raw for c in chain] + raws)
    return {"run_id": info.run_id, "run_name": info.manifest.name, **ledger.to_dict()}
