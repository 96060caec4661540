"""``p2pdiloco models``: the model registry with parameter counts and memory needs."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console

from p2pdiloco.cli.common import user_errors
from p2pdiloco.dashboard.tables import models_table
from p2pdiloco.errors import ConfigError
from p2pdiloco.train.memory import PRECISIONS, estimate_memory
from p2pdiloco.train.model_specs import get_spec, model_names, parameter_count


def describe_models(precisions: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in model_names():
        spec = get_spec(name)
        rows.append(
            {
                "name": name,
                "description": spec.description,
                "parameters": parameter_count(name),
                "num_layers": spec.num_layers,
                "hidden_size": spec.hidden_size,
                "intermediate_size": spec.intermediate_size,
                "num_heads": spec.num_heads,
                "num_kv_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim,
                "vocab_size": spec.vocab_size,
                "tokenizer": spec.tokenizer,
                "hf_id": spec.hf_id or None,
                "train_micro_batch": spec.train_micro_batch,
                "train_seq_len": spec.train_seq_len,
                "memory": {p: estimate_memory(name, p).as_dict() for p in precisions},
            }
        )
    return rows


@user_errors
def models(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    precision: Annotated[
        list[str] | None,
        typer.Option(help=f"Precision(s) to estimate memory for: {', '.join(PRECISIONS)}."),
    ] = None,
) -> None:
    """List models with parameter counts and the memory a training island needs."""
    chosen = precision or list(PRECISIONS)
    for p in chosen:
        if p not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, not '{p}'")
    rows = describe_models(chosen)
    if json_out:
        print(json.dumps({"models": rows}, indent=2))
    else:
        out = Console()
        out.print(models_table(rows, chosen, out.width))
