"""``p2pdiloco status``: runs and peers as the DHT sees them, the contribution leaderboard, or
a run's certified loss curve.

The DHT and its torch-backed stack load only when a command needs them: ``status --api`` reads
a bootstrap's HTTP summary with the standard library and answers in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from p2pdiloco.cli.common import user_errors
from p2pdiloco.dashboard.status import curve_view, leaderboard_view, status_view
from p2pdiloco.errors import ConfigError, UserError

if TYPE_CHECKING:
    from p2pdiloco.protocol.records import RunManifest

# Keys every ``status --json`` object has (docs/cli.md); ``--api`` adds the server's "server".
STATE_KEYS = ("time", "runs", "peers", "bootstraps", "rejected_records")


@user_errors
def status(
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Bootstrap multiaddr (repeatable).")
    ] = None,
    leaderboard: Annotated[
        bool,
        typer.Option("--leaderboard", help="Rank peers by verified accepted tokens."),
    ] = False,
    curve: Annotated[
        bool,
        typer.Option(
            "--curve",
            help="The run's certified eval loss over versions and tokens (ADR 0059).",
        ),
    ] = False,
    run: Annotated[
        str | None,
        typer.Option(help="Run id (prefix) for --leaderboard / --curve [default: busiest]."),
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="--leaderboard / --curve from a node's state directory instead of the network."
        ),
    ] = None,
    api: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="A bootstrap's HTTP address (http://HOST:PORT): read its /api/v1/state instead "
            "of joining the DHT; faster, and trusts that server's view.",
        ),
    ] = None,
    dht: Annotated[
        bool,
        typer.Option(
            "--dht",
            help="Read and verify every record through a DHT node of this machine, even when "
            "the bootstrap server serves its view on its default web port (slower).",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show runs, peers (direct or relayed), their versions and throughput; or, with
    --leaderboard, every peer's contribution as certified by the committees' receipts; or,
    with --curve, the eval loss the committees certified, version by version.

    Without --api or --dht, the bootstrap server given is first asked for its view on its
    default web port (what --api reads; under a second); else the DHT is read (seconds)."""
    if api is not None and leaderboard:
        raise ConfigError("--api shows runs and peers; --leaderboard needs --bootstrap")
    if api is not None and curve:
        raise ConfigError("--api shows runs and peers; --curve needs --bootstrap")
    if leaderboard and curve:
        raise ConfigError("give --leaderboard or --curve, not both")
    if leaderboard or curve:
        run_id, manifest, raws = (
            _certs_offline(state_dir) if state_dir else _certs_online(bootstrap, run)
        )
    if curve:
        shown = _curve(run_id, manifest, raws)
        if json_out:
            print(json.dumps(shown, indent=2))
        else:
            out = Console()
            out.print(curve_view(shown, out.width))
        return
    if leaderboard:
        from p2pdiloco.core.ledger import build_ledger

        board = {
            "run_id": run_id,
            "run_name": manifest.name,
            **build_ledger(run_id, manifest, raws).to_dict(),
        }
        if json_out:
            print(json.dumps(board, indent=2))
        else:
            out = Console()
            out.print(leaderboard_view(board, out.width))
        return
    if api is not None:
        state = _state_from_api(api)
    else:
        state = (None if dht else _state_from_bootstrap_page(bootstrap)) or _state_from_dht(
            bootstrap
        )
    if json_out:
        print(json.dumps(state, indent=2))
    else:
        out = Console()
        out.print(status_view(state, out.width))


def _state_from_bootstrap_page(bootstrap: list[str] | None) -> dict[str, Any] | None:
    """The view of the first bootstrap server given that serves ``/api/v1/state`` on its host's
    default web port and names itself there by the peer id of its address (so it is that
    server, not another one on its host); None if none does within a second. Its view is the
    one ``--api`` reads: records that server verified."""
    from p2pdiloco.cli.net_common import bootstrap_addrs
    from p2pdiloco.net.bootstrap_config import DEFAULT_HTTP_PORT
    from p2pdiloco.preflight.network import parse_bootstrap

    addrs, _ = bootstrap_addrs(bootstrap)
    for addr in addrs:
        target = parse_bootstrap(addr)
        if isinstance(target, str):
            continue
        host = f"[{target.host}]" if ":" in target.host else target.host
        try:
            state = _state_from_api(f"http://{host}:{DEFAULT_HTTP_PORT}", timeout=1.0)
        except UserError:
            continue
        server = state.get("server")
        if isinstance(server, dict) and server.get("peer_id") == addr.rsplit("/", 1)[1]:
            return state
    return None


def _state_from_dht(bootstrap: list[str] | None) -> dict[str, Any]:
    """Every record read and verified here, through a short-lived client DHT node."""
    from p2pdiloco.cli.net_common import dht_client

    with dht_client(bootstrap) as dht:  # a dead bootstrap is refused before hivemind loads
        from p2pdiloco.net.discovery import collect_state

        return collect_state(dht).to_dict()


def _state_from_api(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """``GET <url>/api/v1/state`` of a bootstrap server (its last verified view of the DHT).

    Raises ConfigError for a URL that is not http(s), UserError (one line) when the server
    cannot be reached or does not answer with a p2pdiloco state.
    """
    import urllib.request

    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"--api takes an address like http://127.0.0.1:8080, not '{url}'")
    endpoint = base if base.endswith("/api/v1/state") else f"{base}/api/v1/state"
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout) as resp:
            state = json.load(resp)
    except (OSError, ValueError) as e:  # URLError and timeouts are OSError; bad JSON ValueError
        why = getattr(e, "reason", None) or e
        raise UserError(f"cannot read {endpoint}: {why}") from None
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        raise UserError(f"{endpoint} did not answer with a p2pdiloco network state")
    return state


def _curve(run_id: str, manifest: RunManifest, raws: list[bytes]) -> dict[str, Any]:
    """The run's certified loss curve from the chain ``raws`` verify (``core.curve``), with its
    planned size: a run past its planned rounds says so (ADR 0053)."""
    from p2pdiloco.core.curve import loss_curve
    from p2pdiloco.core.ledger import verified_chain

    chain, ignored = verified_chain(run_id, manifest, raws)
    curve = loss_curve(chain)
    planned = manifest.plan.rounds if manifest.plan is not None else None
    return {
        "run_id": run_id,
        "run_name": manifest.name,
        "versions": curve.version,
        "tokens": curve.tokens,
        "evaluated": manifest.held_out is not None,
        "planned_rounds": planned,
        "past_plan": planned is not None and curve.version > planned,
        "points": curve.to_list(),
        "ignored": ignored,
    }


def _certs_offline(state_dir: Path) -> tuple[str, RunManifest, list[bytes]]:
    """A node's kept certificates and the signed manifest it saved."""
    from p2pdiloco.protocol.records import parse_manifest
    from p2pdiloco.protocol.signing import InvalidRecord, open_envelope

    try:
        env = open_envelope((state_dir / "manifest.json").read_bytes(), kind="manifest")
        run_id, manifest = parse_manifest(env)
    except (OSError, InvalidRecord) as e:
        raise UserError(f"no valid run manifest in {state_dir}: {e}") from None
    raws = [p.read_bytes() for p in sorted((state_dir / "certs").glob("*.json"))]
    return run_id, manifest, raws


def _certs_online(
    bootstrap: list[str] | None, run: str | None
) -> tuple[str, RunManifest, list[bytes]]:
    """Certificates fetched from the run's nodes (any of them may lie: each is verified)."""
    from p2pdiloco.cli.net_common import dht_client

    with dht_client(bootstrap) as dht:  # a dead bootstrap is refused before hivemind loads
        from p2pdiloco.net.cert_records import read_certificates
        from p2pdiloco.net.discovery import read_peers, read_runs
        from p2pdiloco.net.p2p_bridge import P2PBridge
        from p2pdiloco.net.transport import P2PTransport
        from p2pdiloco.sync.fetch import walk_chain

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
    return info.run_id, info.manifest, [c.raw for c in chain] + raws
