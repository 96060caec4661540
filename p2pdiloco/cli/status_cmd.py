"""``p2pdiloco status``: runs and peers as the DHT sees them."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from p2pdiloco.cli.common import user_errors
from p2pdiloco.cli.net_common import dht_client
from p2pdiloco.dashboard.status import status_view
from p2pdiloco.net.discovery import collect_state


@user_errors
def status(
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Bootstrap multiaddr (repeatable).")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show runs, peers (direct or relayed), their versions and throughput."""
    with dht_client(bootstrap) as dht:
        state = collect_state(dht).to_dict()
    if json_out:
        print(json.dumps(state, indent=2))
    else:
        Console().print(status_view(state))
