"""``p2pdiloco keys new|show``: the node's ed25519 identity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from p2pdiloco.cli.common import user_errors
from p2pdiloco.protocol.identity import Identity, IdentityError, default_identity_path

app = typer.Typer(help="Create or show this node's identity key.", no_args_is_help=True)

IdentityOpt = Annotated[
    Path | None, typer.Option("--identity", help="Key file [default: XDG data path].")
]


@app.command("new", short_help="Create a new identity key.")
@user_errors
def new(
    identity: IdentityOpt = None,
    force: Annotated[
        bool, typer.Option(help="Replace an existing key (its peer id is lost).")
    ] = False,
) -> None:
    """Create a new key; refuses to replace an existing one without --force."""
    path = identity or default_identity_path()
    if path.exists() and not force:
        raise IdentityError(f"'{path}' already holds a key; pass --force to replace it")
    ident = Identity.generate()
    ident.save(path, overwrite=force)
    print(f"peer id {ident.peer_id}\nkey     {path}")


@app.command("show", short_help="Show the peer id and public key.")
@user_errors
def show(
    identity: IdentityOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show the peer id and public key of the key file (created on first use by other commands)."""
    path = identity or default_identity_path()
    ident = Identity.load(path)
    if json_out:
        print(
            json.dumps(
                {"peer_id": ident.peer_id, "public_key": ident.public_key_hex, "path": str(path)}
            )
        )
    else:
        print(f"peer id    {ident.peer_id}\npublic key {ident.public_key_hex}\nkey file   {path}")
