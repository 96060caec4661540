"""Model registry: Gemma 3 text architectures (through transformers) and small family members.

Every model is a ``Gemma3ForCausalLM``. The published sizes carry their published shapes; the
``gemma-tiny`` and ``gemma-small`` members keep the architecture (GQA, sliding/global layer mix,
QK-norm, tied embeddings) at CPU size, with the byte-level tokenizer's vocabulary.

Random initialisation is a pure function of the run seed: it runs on the CPU in fp32 under a
forked RNG, so every machine that builds the same model with the same seed gets bit-identical
weights (``tests/test_models.py`` checks this across processes through the state hash).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.errors import UserError

log = logging.getLogger(__name__)

# Byte tokenizer: 256 bytes + pad/bos/eos, padded to a multiple of 8 for the embedding matmul.
BYTE_VOCAB_SIZE = 264


class ModelError(UserError):
    """A model name, checkpoint or size problem, with a one-line message for the user."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape and defaults of one registered model."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    sliding_window: int
    # Default tokenizer: "byte", or a Hugging Face id / local path.
    tokenizer: str
    # Where the published weights live, for --init-from hints; empty for our own members.
    hf_id: str = ""
    query_pre_attn_scalar: int | None = None
    # Global-attention RoPE scaling of the 4B+ models (linear, factor 8).
    rope_linear_factor: float | None = None
    max_position_embeddings: int = 32768
    # The batch the memory estimate assumes: micro-batch sequences × sequence length.
    train_micro_batch: int = 1
    train_seq_len: int = 4096
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def hf_config(self) -> Any:
        """The ``Gemma3TextConfig`` for this shape (a fresh object each call)."""
        from transformers import Gemma3TextConfig

        full: dict[str, Any] = {"rope_type": "default", "rope_theta": 1_000_000.0}
        if self.rope_linear_factor:
            full = {"rope_type": "linear", "factor": self.rope_linear_factor, "rope_theta": 1e6}
        config = Gemma3TextConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            sliding_window=self.sliding_window,
            query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": full,
            },
            tie_word_embeddings=True,
            use_cache=False,
            **self.extra,
        )
        config._attn_implementation = "sdpa"
        return config


_SPECS: list[ModelSpec] = [
    ModelSpec(
        name="gemma-tiny",
        hidden_size=128,
        intermediate_size=512,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=BYTE_VOCAB_SIZE,
        sliding_window=64,
        tokenizer="byte",
        max_position_embeddings=2048,
        train_micro_batch=8,
        train_seq_len=128,
        description="CPU demo and test member (byte tokenizer)",
        extra={"pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258},
    ),
    ModelSpec(
        name="gemma-small",
        hidden_size=512,
        intermediate_size=2048,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        vocab_size=BYTE_VOCAB_SIZE,
        sliding_window=256,
        tokenizer="byte",
        max_position_embeddings=4096,
        train_micro_batch=16,
        train_seq_len=512,
        description="small CPU / single-GPU member (byte tokenizer)",
        extra={"pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258},
    ),
    ModelSpec(
        name="gemma-270m",
        hidden_size=640,
        intermediate_size=2048,
        num_layers=18,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        vocab_size=262_144,
        sliding_window=512,
        tokenizer="google/gemma-3-270m",
        hf_id="google/gemma-3-270m",
        description="Gemma 3 270M",
    ),
    ModelSpec(
        name="gemma-1b",
        hidden_size=1152,
        intermediate_size=6912,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        vocab_size=262_144,
        sliding_window=512,
        tokenizer="google/gemma-3-1b-pt",
        hf_id="google/gemma-3-1b-pt",
        description="Gemma 3 1B",
    ),
    ModelSpec(
        name="gemma-4b",
        hidden_size=2560,
        intermediate_size=10240,
        num_layers=34,
        num_heads=8,
        num_kv_heads=4,
        head_dim=256,
        vocab_size=262_208,
        sliding_window=1024,
        tokenizer="google/gemma-3-4b-pt",
        hf_id="google/gemma-3-4b-pt",
        rope_linear_factor=8.0,
        max_position_embeddings=131_072,
        description="Gemma 3 4B (text tower)",
    ),
    ModelSpec(
        name="gemma-12b",
        hidden_size=3840,
        intermediate_size=15360,
        num_layers=48,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        vocab_size=262_208,
        sliding_window=1024,
        tokenizer="google/gemma-3-12b-pt",
        hf_id="google/gemma-3-12b-pt",
        rope_linear_factor=8.0,
        max_position_embeddings=131_072,
        description="Gemma 3 12B (text tower)",
    ),
    ModelSpec(
        name="gemma-27b",
        hidden_size=5376,
        intermediate_size=21504,
        num_layers=62,
        num_heads=32,
        num_kv_heads=16,
        head_dim=128,
        vocab_size=262_208,
        sliding_window=1024,
        tokenizer="google/gemma-3-27b-pt",
        hf_id="google/gemma-3-27b-pt",
        query_pre_attn_scalar=168,
        rope_linear_factor=8.0,
        max_position_embeddings=131_072,
        description="Gemma 3 27B (text tower)",
    ),
]
REGISTRY: dict[str, ModelSpec] = {s.name: s for s in _SPECS}


def model_names() -> list[str]:
    """Registered names, smallest first."""
    return [s.name for s in _SPECS]


def get_spec(name: str) -> ModelSpec:
    """Look a model up by name; raise ModelError naming the known models if it is unknown."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelError(
            f"unknown model '{name}'; known models: {', '.join(model_names())}"
        ) from None


@functools.cache
def parameter_count(name: str) -> int:
    """Trainable parameters (tied embeddings counted once), counted on the meta device."""
    from transformers import Gemma3ForCausalLM

    with torch.device("meta"):
        model = Gemma3ForCausalLM(get_spec(name).hf_config())
    return sum(p.numel() for p in model.parameters())


def _seeded_build(spec: ModelSpec, seed: int) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM

    # Build on the CPU in fp32 under a forked RNG: the draw sequence then depends only on the
    # seed and the architecture, never on the caller's RNG state or the target device.
    with torch.random.fork_rng(devices=[]):
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


def _load_pretrained(spec: ModelSpec, path: Path) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM

    if not path.exists():
        raise ModelError(f"--init-from '{path}' does not exist")
    try:
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
    from transformers import Gemma3ForCausalLM

    with torch.device("meta"):
        return Gemma3ForCausalLM(spec.hf_config())


def named_trainable(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The model's parameters by name, tied ones once: the canonical training state."""
    yield from model.named_parameters(remove_duplicate=True)


def param_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached views of the trainable parameters, keyed by name (no copies)."""
    return {n: p.detach() for n, p in named_trainable(model)}
