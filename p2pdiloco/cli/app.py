"""The ``p2pdiloco`` command.

Start-up stays fast: a command's module (and torch, hivemind or transformers behind it) is
imported only when that command runs or shows its own help. ``p2pdiloco --help`` lists the
commands from ``COMMANDS`` without importing any of them, and ``--version`` imports nothing but
typer. ``tests/test_cli_startup.py`` keeps it so: importing this module loads no heavy package.
"""

from __future__ import annotations

import importlib
import sys
from typing import Annotated, Any, NamedTuple

import typer
from typer import _click as click  # typer's own copy of click, the one its classes extend
from typer.core import TyperCommand, TyperGroup, TyperOption

from p2pdiloco import __version__
from p2pdiloco.cli.common import setup_logging


class LazyCommand(NamedTuple):
    module: str  # imported only when the command runs or shows its help
    attr: str  # a command function, or a typer.Typer for a command group
    summary: str  # the line ``p2pdiloco --help`` shows: keep it in step with the docstring


COMMANDS: dict[str, LazyCommand] = {
    "models": LazyCommand(
        "p2pdiloco.cli.models_cmd", "models", "List models with their size and training memory."
    ),
    "simulate": LazyCommand(
        "p2pdiloco.cli.simulate_cmd", "simulate", "Train DiLoCo beside data-parallel, no network."
    ),
    "netsim": LazyCommand(
        "p2pdiloco.cli.netsim_cmd", "netsim", "Simulate a network of peers on the real round code."
    ),
    "demo": LazyCommand(
        "p2pdiloco.cli.demo_cmd", "demo", "Run a whole network on this machine and verify it."
    ),
    "doctor": LazyCommand(
        "p2pdiloco.cli.doctor_cmd", "doctor", "Check this machine and settings before joining."
    ),
    "bootstrap": LazyCommand(
        "p2pdiloco.cli.bootstrap_cmd", "bootstrap", "Run a public bootstrap server."
    ),
    "join": LazyCommand("p2pdiloco.cli.join_cmd", "join", "Join a training run and train in it."),
    "status": LazyCommand(
        "p2pdiloco.cli.status_cmd", "status", "Show runs and peers, or the leaderboard."
    ),
    "export": LazyCommand(
        "p2pdiloco.cli.export_cmd", "export", "Write a certified version as a Hugging Face model."
    ),
    "sample": LazyCommand(
        "p2pdiloco.cli.export_cmd", "sample", "Generate text from a run's newest certified model."
    ),
    "keys": LazyCommand("p2pdiloco.cli.keys_cmd", "app", "Create or show this node's key."),
    "run": LazyCommand("p2pdiloco.cli.run_cmd", "app", "Create and publish training runs."),
}


def load_command(name: str) -> click.Command:
    """The real click command behind ``name``, importing its module now."""
    spec = COMMANDS[name]
    target = getattr(importlib.import_module(spec.module), spec.attr)
    if isinstance(target, typer.Typer):
        cmd: click.Command = typer.main.get_group(target)
    else:
        single = typer.Typer(add_completion=False)
        single.command(name=name)(target)
        cmd = typer.main.get_command(single)
    cmd.name = name
    _plain_help(cmd)
    return cmd


def _plain_help(cmd: click.Command) -> None:
    """Plain click help for a command and its subcommands: rich markup would eat
    ``[default: ...]`` in help texts, and rich's panels add ``<bool>`` to every flag. A
    repeatable option shows its element type (``--bootstrap <str>``, not ``<list[str]>``)."""
    cmd.rich_markup_mode = None  # type: ignore[attr-defined]
    ctx = click.Context(cmd)
    for param in cmd.params:
        if isinstance(param, TyperOption) and param.multiple and param.metavar is None:
            label = param.display_type(ctx)
            if label.startswith("<list[") and label.endswith("]>"):
                param.metavar = f"<{label[6:-2]}>"
    for sub in getattr(cmd, "commands", {}).values():
        _plain_help(sub)


class _Stub(TyperCommand):
    """Stands in for a command in the listing; parsing its arguments loads the real one."""

    def __init__(self, name: str) -> None:
        super().__init__(
            name, short_help=COMMANDS[name].summary, add_help_option=False, rich_markup_mode=None
        )

    def make_context(
        self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any
    ) -> Any:
        assert self.name is not None
        return load_command(self.name).make_context(info_name, args, parent=parent, **extra)


class _LazyGroup(TyperGroup):
    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands.update({name: _Stub(name) for name in COMMANDS})


app = typer.Typer(
    name="p2pdiloco",
    cls=_LazyGroup,
    help="Peer-to-peer volunteer pre-training of language models with DiLoCo.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
)


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
    try:
        app()
    except SystemExit as e:
        # typer's exit for a KeyboardInterrupt: a Ctrl-C before the command installed its own
        # handler (``signals.stop_event``), while its modules load. Said, not left silent.
        if e.code == 130:
            print("interrupted", file=sys.stderr, flush=True)
        raise
