"""Model registry: Gemma 3 text architectures (through transformers) and small family members.

Every model is a ``Gemma3ForCausalLM``. The published sizes carry their published shapes; the
``gemma-tiny`` and ``gemma-small`` members keep the architecture (GQA, sliding/global layer mix,
QK-norm, tied embeddings) at CPU size, with the byte-level tokenizer's vocabulary.

Random initialisation is a pure function of the run seed: it runs on the CPU in fp32 under a
forked RNG, so every machine that builds the same model with the same seed gets bit-identical
weights (``tests/test_models.py`` checks this across processes through the state hash).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from p2pdiloco.train.hf_import import building_models, import_transformers
from p2pdiloco.train.model_specs import (
    BYTE_VOCAB_SIZE,
    REGISTRY,
    ModelError,
    ModelSpec,
    get_spec,
    model_names,
    parameter_count,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "REGISTRY",
    "ModelError",
    "ModelSpec",
    "build_model",
    "get_spec",
    "meta_parameter_count",
    "model_names",
    "named_trainable",
    "param_state",
    "parameter_count",
]


def meta_parameter_count(name: str) -> int:
    """The count of the model transformers builds on the meta device (the test oracle)."""
    return sum(p.numel() for p in _meta_model(get_spec(name)).parameters())


def _seeded_build(spec: ModelSpec, seed: int) -> torch.nn.Module:
    import_transformers()
    from transformers import Gemma3ForCausalLM

    # Build on the CPU in fp32 under a forked RNG: the draw sequence then depends only on the
    # seed and the architecture, never on the caller's RNG state or the target device.
    with building_models(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = Gemma3ForCausalLM(spec.hf_config())
    return model.float()


def build_model(
    name: str,
    *,
    seed: int,
    init_from: str | Path | None = None,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    """The model for a run: random init from ``seed``, or weights from a local HF checkpoint.

    Raises ModelError if ``init_from`` does not exist, cannot be loaded, or holds a different
    shape than ``name``. Weights are fp32 (mixed precision is applied by autocast in training).
    """
    spec = get_spec(name)
    if init_from is None:
        model = _seeded_build(spec, seed)
    else:
        model = _load_pretrained(spec, Path(init_from))
    model.train()
    return model.to(device)


def build_for_loading(
    name: str, *, device: torch.device | str = "cpu", params_on_meta: bool = False
) -> torch.nn.Module:
    """The model's modules with *uninitialised* parameters, allocated on ``device``, for a
    caller that loads every parameter next (a certified state).

    ``build_model`` draws the seeded init on the CPU and then moves it: for gemma-12b that is
    12 B normal draws and 47 GB of host memory before a GPU learner can load the state it came
    for. Buffers (rotary frequencies, the embedding scale) are computed from the config as
    usual. Where this transformers has no ``no_init_weights`` the init runs (slower, same
    result once loaded). ``params_on_meta``: parameters on the meta device (no memory), buffers
    on ``device``: what an island shards before it allocates only its own shards.
    """
    spec = get_spec(name)
    import_transformers()
    from transformers import Gemma3ForCausalLM

    meta = _params_on_meta() if params_on_meta else contextlib.nullcontext()
    with building_models(), _no_init_weights(), torch.device(device), meta:
        model = Gemma3ForCausalLM(spec.hf_config())
    model.tie_weights()  # skipped with the init: the output head shares the embedding
    model.train()
    return model.float()


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Every parameter a module registers in the block moves to the meta device as it is
    registered; buffers stay where they were made."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            assert p is not None
            module._parameters[name] = torch.nn.Parameter(
                p.to("meta"), requires_grad=p.requires_grad
            )

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _no_init_weights() -> contextlib.AbstractContextManager[object]:
    try:  # transformers 5
        from transformers.initialization import no_init_weights
    except ImportError:
        try:  # transformers 4.x
            from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef,attr-defined]
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def _load_pretrained(spec: ModelSpec, path: Path) -> torch.nn.Module:
    import_transformers()
    from transformers import Gemma3ForCausalLM

    if not path.exists():
        raise ModelError(f"--init-from '{path}' does not exist")
    try:
        with building_models():
            model = Gemma3ForCausalLM.from_pretrained(
                str(path), local_files_only=True, dtype=torch.float32
            )
    except Exception as e:  # transformers raises many types for a bad checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot load checkpoint '{path}': {first}") from e
    expected = {n: tuple(p.shape) for n, p in named_trainable(_meta_model(spec))}
    got = {n: tuple(p.shape) for n, p in named_trainable(model)}
    if expected != got:
        raise ModelError(
            f"checkpoint '{path}' does not have the shape of {spec.name} "
            f"({sum(1 for _ in got)} tensors vs {len(expected)} expected)"
        )
    model.config._attn_implementation = "sdpa"
    return model.float()


def _meta_model(spec: ModelSpec) -> torch.nn.Module:
    import_transformers()
    from transformers import Gemma3ForCausalLM

    with building_models(), torch.device("meta"):
        return Gemma3ForCausalLM(spec.hf_config())


def named_trainable(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The model's parameters by name, tied ones once: the canonical training state."""
    yield from model.named_parameters(remove_duplicate=True)


def param_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached views of the trainable parameters, keyed by name (no copies)."""
    return {n: p.detach() for n, p in named_trainable(model)}
