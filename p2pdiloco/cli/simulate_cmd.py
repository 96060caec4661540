"""``p2pdiloco simulate``: M DiLoCo learners in one process beside a data-parallel baseline."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from p2pdiloco.choices import ATTACKS, CODECS, RULES, UPDATE_CODECS
from p2pdiloco.cli.common import user_errors
from p2pdiloco.dashboard.progress import progress_bar
from p2pdiloco.dashboard.tables import simulation_summary
from p2pdiloco.errors import ConfigError
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.train.configs import InnerConfig, OuterConfig, SimulateConfig
from p2pdiloco.train.model_specs import get_spec

_d = SimulateConfig()


def parse_agg_params(items: list[str]) -> dict[str, float]:
    """``--agg-param KEY=NUMBER`` values as a dict; ConfigError for any other shape."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--agg-param must look like KEY=NUMBER, not '{item}'") from None
    return out


def sync_rules(**fields: object) -> SyncRules:
    """Validated ``SyncRules`` from CLI values; ConfigError naming the first bad one."""
    try:
        return SyncRules.model_validate(fields)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        where = ".".join(map(str, err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not where:  # a rule relating two fields: the message names them
            raise ConfigError(f"invalid sync rules: {msg}") from None
        raise ConfigError(f"invalid sync rule {where}: {msg}") from None


_i = InnerConfig()
_o = OuterConfig()


@user_errors
def simulate(
    learners: Annotated[int, typer.Option(help="DiLoCo learners (M).")] = _d.learners,
    inner_steps: Annotated[int, typer.Option(help="Inner steps per round (H).")] = _d.inner_steps,
    rounds: Annotated[int, typer.Option(help="Outer rounds.")] = _d.rounds,
    model: Annotated[str, typer.Option(help="Model name (see `p2pdiloco models`).")] = _d.model,
    data: Annotated[
        str,
        typer.Option(help="'embedded', a directory/file of text or .jsonl, or hf:NAME[@SPLIT]."),
    ] = _d.data,
    seed: Annotated[int, typer.Option(help="Run seed: init, data order, sharding.")] = _d.seed,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    fragments: Annotated[
        int, typer.Option(help="Streaming DiLoCo fragments (1 = plain DiLoCo).")
    ] = _o.fragments,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda[:N], mps or xla.")] = _d.device,
    batch_size: Annotated[int, typer.Option(help="Sequences per inner step.")] = _i.batch_size,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = _i.seq_len,
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per step.")] = _i.grad_accum,
    inner_lr: Annotated[float, typer.Option(help="Peak AdamW lr.")] = _i.lr,
    warmup_steps: Annotated[
        int | None, typer.Option(help="Warmup steps [default: 10% of a learner's steps].")
    ] = None,
    outer_lr: Annotated[float, typer.Option(help="Outer Nesterov lr.")] = _o.lr,
    outer_momentum: Annotated[float, typer.Option(help="Outer momentum.")] = _o.momentum,
    tokenizer: Annotated[
        str | None, typer.Option(help="'byte', a local tokenizer dir or hub id.")
    ] = None,
    init_from: Annotated[
        str | None, typer.Option(help="Local Hugging Face checkpoint to start from.")
    ] = None,
    eval_batches: Annotated[int, typer.Option(help="Eval batches per round.")] = _d.eval_batches,
    baseline: Annotated[bool, typer.Option(help="Also train the data-parallel baseline.")] = True,
    aggregation: Annotated[
        str, typer.Option(help=f"Merge rule: {', '.join(RULES)}.")
    ] = _d.rules.aggregation,
    agg_param: Annotated[
        list[str] | None, typer.Option(help="Rule parameter KEY=VALUE, e.g. f=1 (repeatable).")
    ] = None,
    clone_factor: Annotated[
        float | None,
        typer.Option(
            metavar="FACTOR",
            help="Fold screened deltas closer than this × the honest spread into one vote "
            "(ADR 0036) [default: off].",
        ),
    ] = _d.rules.clone_factor,
    screen_norm_factor: Annotated[
        float, typer.Option(help="Screen out deltas above this × the median norm (0: off).")
    ] = _d.rules.screen_norm_factor or 0.0,
    weight_cap: Annotated[
        float, typer.Option(help="Largest share of the merge weight one learner may hold.")
    ] = _d.rules.weight_cap,
    adversaries: Annotated[int, typer.Option(help="The last N learners attack.")] = 0,
    attack: Annotated[str, typer.Option(help=f"Attack: {', '.join(ATTACKS)}.")] = _d.attack,
    compression: Annotated[
        str, typer.Option(help=f"Delta codec with error feedback: {', '.join(CODECS)}.")
    ] = _d.compression,
    update_compression: Annotated[
        str,
        typer.Option(
            help=f"Codec of the merged update the outer step applies, as a committee certifies "
            f"it: {', '.join(UPDATE_CODECS)}; with --update-form params also topk2."
        ),
    ] = _d.rules.update_codec,
    update_form: Annotated[
        str,
        typer.Option(
            help="What the certified update is: 'gradient' (the merged pseudo-gradient, dense "
            "codecs) or 'params' (the parameters' change with the committee's error feedback, "
            "any codec: ADR 0064)."
        ),
    ] = _d.rules.update_form,
    update_k: Annotated[
        int | None,
        typer.Option(help="Entries kept per 4096 by a topk2 update codec [default: 64]."),
    ] = _d.rules.update_k,
) -> None:
    """Train M DiLoCo learners in one process, next to data-parallel on the same tokens."""
    total = rounds * inner_steps
    cfg = SimulateConfig(
        model=model,
        learners=learners,
        inner_steps=inner_steps,
        rounds=rounds,
        seed=seed,
        data=data,
        tokenizer=tokenizer,
        device=device,
        eval_batches=eval_batches,
        init_from=init_from,
        baseline=baseline,
        inner=InnerConfig(
            lr=inner_lr,
            warmup_steps=warmup_steps if warmup_steps is not None else max(1, total // 10),
            batch_size=batch_size,
            seq_len=seq_len,
            grad_accum=grad_accum,
        ),
        outer=OuterConfig(lr=outer_lr, momentum=outer_momentum, fragments=fragments),
        rules=sync_rules(
            aggregation=aggregation,
            aggregation_params=parse_agg_params(agg_param or []),
            screen_norm_factor=screen_norm_factor or None,
            clone_factor=clone_factor,
            weight_cap=weight_cap,
            update_codec=update_compression,
            update_form=update_form,
            update_k=update_k,
        ),
        adversaries=adversaries,
        attack=attack,
        compression=compression,
    )
    get_spec(model)  # an unknown model is a one-line error before torch is imported
    from p2pdiloco.harness.simulate import run_simulation

    console = Console(stderr=True)

    with progress_bar(console) as update:
        result = run_simulation(cfg, progress=update).to_dict()
    if json_out:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out = Console()
        out.print(simulation_summary(result, out.width))
