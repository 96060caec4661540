"""``p2pdiloco export`` and ``p2pdiloco sample``: the model a run certified, out of the node.

Both read a verified certified version from the node's state directory (``p2pdiloco.export``);
``sample`` also reads a directory ``export`` wrote. torch and transformers are imported only
once the flags are checked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from p2pdiloco.cli.common import user_errors
from p2pdiloco.cli.join_cmd import default_state_dir
from p2pdiloco.errors import ConfigError, UserError

if TYPE_CHECKING:
    from p2pdiloco.export import CertifiedVersion

RunOpt = Annotated[
    str | None,
    typer.Option(
        "--run", metavar="ID", help="Run id (a prefix of 8+ hex digits), or the run's name."
    ),
]
StateDirOpt = Annotated[
    Path | None,
    typer.Option(help="The node's state directory [default: the one `join` uses for the run]."),
]
VersionOpt = Annotated[
    int | None,
    typer.Option("--version", metavar="N", help="Certified version [default: newest held]."),
]


def state_dir_of(run: str | None, state_dir: Path | None) -> tuple[Path, str | None]:
    """``state_dir``, else the one ``join`` keeps for the run whose id starts with ``run`` or,
    when ``run`` is no id prefix, whose manifest is named ``run``; with the run id (or prefix)
    the state must hold. Raises UserError if neither is given, none is found or the run is
    ambiguous."""
    if state_dir is not None:
        if run and not _HEX_PREFIX.fullmatch(run):  # a name: that directory's run must bear it
            named = _named([state_dir], run)
            if not named:
                raise UserError(f"{state_dir} holds no run named {run}")
            return named[0]
        return state_dir, run
    if not run:
        raise ConfigError("give --run ID (or --state-dir DIR)")
    runs = default_state_dir(run).parent
    held = sorted(d for d in runs.iterdir() if d.is_dir()) if runs.is_dir() else []
    if _HEX_PREFIX.fullmatch(run):
        found = [d for d in held if d.name.startswith(run[:16])]
        if len(found) > 1:
            raise UserError(f"run {run} is ambiguous here: {', '.join(d.name for d in found)}")
        if found:
            return found[0], run
    named = _named(held, run)
    if len(named) > 1:
        ids = ", ".join(run_id[:16] for _, run_id in named)
        raise UserError(f"{len(named)} runs named {run} are held here ({ids}): pass --run ID")
    if named:
        return named[0]
    raise UserError(
        f"no local state of run {run} under {runs} (a node that joined the run keeps one; "
        "give its id or name, or pass --state-dir)"
    )


_HEX_PREFIX = re.compile(r"[0-9a-f]{8,64}")


def _named(held: list[Path], name: str) -> list[tuple[Path, str]]:
    """The state directories among ``held`` whose verified manifest is named ``name``, with
    their run ids (one whose manifest does not verify is skipped: ``export`` says why when
    given its id)."""
    from p2pdiloco.export import ExportError, read_manifest

    out = []
    for d in held:
        try:
            run_id, manifest = read_manifest(d)
        except ExportError:
            continue
        if manifest.name == name:
            out.append((d, run_id))
    return out


def _certified(run: str | None, state_dir: Path | None, version: int | None) -> CertifiedVersion:
    from p2pdiloco.export import load_certified

    directory, run_id = state_dir_of(run, state_dir)
    return load_certified(directory, run_id, version)


def _plain_modes(directory: Path) -> None:
    """The modes a plain ``mkdir`` and ``open`` give under the umask: ``mkdtemp`` makes the
    directory private (0700), and a shared model directory should not be."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


@user_errors
def export(
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="New or empty directory.")],
    run: RunOpt = None,
    version: VersionOpt = None,
    state_dir: StateDirOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Write a certified version as a Hugging Face directory: config.json, model.safetensors,
    the tokenizer files and a model card (README.md) naming the run, version, certificate hash,
    tokens trained and contributors.

    The version's certificate chain must verify from genesis and its state must hash to what
    the certificate signs. Refuses (exit 2, one line) a missing state or version, a chain that
    does not verify and an --out that holds files; nothing is left behind on failure.
    """
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} is not an empty directory")
    cv = _certified(run, state_dir, version)
    from p2pdiloco.export import model_card
    from p2pdiloco.train.hf_export import save_hf_dir

    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside, then renamed: an interrupted export leaves no half directory at --out.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_hf_dir(cv.manifest.model, cv.params, tmp, model_card(cv))
        _plain_modes(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p.name for p in out.iterdir())
    seconds = time.monotonic() - started
    if json_out:
        summary = {
            "run_id": cv.run_id,
            "version": cv.version,
            "cert_hash": cv.cert_hash,
            "tokens": cv.ledger.total_tokens,
            "out": str(out),
            "files": files,
        }
        print(json.dumps(summary))
        return
    print(
        f"run {cv.manifest.name} ({cv.manifest.model}) version {cv.version} exported to {out} "
        f"in {seconds:.1f} s\ncertificate {cv.cert_hash}\n{', '.join(files)}"
    )


@user_errors
def sample(
    prompt: Annotated[str, typer.Option(help="Text the model continues.")],
    run: RunOpt = None,
    version: VersionOpt = None,
    state_dir: StateDirOpt = None,
    model_dir: Annotated[
        Path | None,
        typer.Option(metavar="DIR", help="A directory `export` wrote, instead of --run."),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, max=100_000, help="Tokens to add.")] = 200,
    temperature: Annotated[
        float, typer.Option(min=0.0, help="0: greedy; above: sample at this temperature.")
    ] = 0.0,
    top_k: Annotated[
        int, typer.Option(min=0, help="Sample from the k likeliest tokens (0: all).")
    ] = 50,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
) -> None:
    """Continue --prompt with the newest certified version of a run held here (verified as
    `export` does), or with an exported directory. Prints the prompt and its continuation."""
    if model_dir is not None and (run or state_dir):
        raise ConfigError("give --model-dir or --run/--state-dir, not both")
    if model_dir is not None and not (model_dir / "config.json").is_file():
        raise UserError(f"--model-dir {model_dir} holds no exported model (no config.json)")
    from p2pdiloco.train.hf_export import hf_tokenizer, load_hf_dir, model_from_params
    from p2pdiloco.train.hf_export import sample as generate

    if model_dir is not None:
        model, tokenizer = load_hf_dir(model_dir)
    else:
        cv = _certified(run, state_dir, version)
        model = model_from_params(cv.manifest.model, cv.params)
        tokenizer = hf_tokenizer(cv.manifest.model)
    text = generate(
        model,
        tokenizer,
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
    )
    print(prompt + text)
