"""Start-up stays light: the command loads no heavy package until one of its commands runs, and
every command's help reads cleanly at 80 columns. Timings live in docs/benchmarks.md, not here."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rich.cells import cell_len
from typer.testing import CliRunner

from p2pdiloco.cli.app import COMMANDS, app

HEAVY = ("torch", "hivemind", "transformers", "libp2p", "numpy")


LIGHT = [
    "app",
    "status_cmd",
    "models_cmd",
    "simulate_cmd",
    "run_cmd",
    "join_cmd",
    "netsim_cmd",
    "export_cmd",
]


@pytest.mark.parametrize("module", [f"p2pdiloco.cli.{m}" for m in LIGHT])
def test_importing_the_cli_loads_no_heavy_package(module: str) -> None:
    """``status_cmd`` too: ``status --api`` answers without the DHT stack; ``models`` reads
    sizes from the shapes alone, without building a model; ``simulate`` and ``run create``
    show their help and refuse bad flags before torch or hivemind is imported; ``join``
    refuses bad flags and a missing or mistyped bootstrap address before either."""
    probe = f"import {module}, sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_light_name_lists_are_the_registries() -> None:
    from p2pdiloco import choices
    from p2pdiloco.aggregate import RULES
    from p2pdiloco.compress import CODECS
    from p2pdiloco.train.attacks import ATTACKS

    assert (choices.RULES, choices.CODECS, choices.ATTACKS) == (RULES, CODECS, ATTACKS)


@pytest.mark.parametrize("args", [["--version"], ["--help"]])
def test_version_and_help_load_no_command_module(args: list[str]) -> None:
    probe = (
        "import sys; from p2pdiloco.cli.app import app\n"
        f"try:\n    app({args!r})\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules), "
        "sorted(m for m in sys.modules if m.endswith('_cmd')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[] []"


def test_root_help_lists_every_command() -> None:
    out = CliRunner().invoke(app, ["--help"], terminal_width=80)
    assert out.exit_code == 0, out.output
    for name, spec in COMMANDS.items():
        assert f"  {name}" in out.output and spec.summary in out.output


HELP = [[name] for name in COMMANDS] + [["keys", "new"], ["keys", "show"], ["run", "create"]]


@pytest.mark.parametrize("args", HELP, ids=" ".join)
def test_every_help_is_clean_at_80_columns(args: list[str]) -> None:
    out = CliRunner().invoke(app, [*args, "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    assert out.output.startswith(f"Usage: p2pdiloco {' '.join(args)} ")
    lines = out.output.splitlines()
    assert max(cell_len(line) for line in lines) <= 80, out.output
    for bad in ("<bool>", "<list[", " .\n", "Traceback"):
        assert bad not in out.output, (bad, out.output)
