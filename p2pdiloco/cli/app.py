"""The ``p2pdiloco`` command."""

from __future__ import annotations

from typing import Annotated

import typer

from p2pdiloco import __version__
from p2pdiloco.cli import keys_cmd, run_cmd
from p2pdiloco.cli.bootstrap_cmd import bootstrap
from p2pdiloco.cli.common import setup_logging
from p2pdiloco.cli.demo_cmd import demo
from p2pdiloco.cli.doctor_cmd import doctor
from p2pdiloco.cli.join_cmd import join
from p2pdiloco.cli.models_cmd import models
from p2pdiloco.cli.simulate_cmd import simulate
from p2pdiloco.cli.status_cmd import status

app = typer.Typer(
    name="p2pdiloco",
    help="Peer-to-peer volunteer pre-training of language models with DiLoCo.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(models)
app.command()(simulate)
app.command()(demo)
app.command()(doctor)
app.command()(bootstrap)
app.command()(join)
app.command()(status)
app.add_typer(keys_cmd.app, name="keys")
app.add_typer(run_cmd.app, name="run")


def _version(value: bool) -> None:
    if value:
        print(f"p2pdiloco {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print version.")
    ] = False,
) -> None:
    setup_logging(verbose)


def main() -> None:
    app()
