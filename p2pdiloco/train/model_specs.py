"""Model shapes: the registry of Gemma 3 text architectures, their sizes and parameter counts.

Pure data, no torch and no transformers: ``models``, ``doctor`` and ``join``'s fit check read
it in milliseconds. Building a model from a spec lives in ``p2pdiloco.train.models``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from p2pdiloco.errors import UserError
from p2pdiloco.train.hf_import import import_transformers

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
        import_transformers()
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
        close = difflib.get_close_matches(name.lower(), model_names(), n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ModelError(
            f"unknown model '{name}'; {hint}known models: {', '.join(model_names())}"
        ) from None


def parameter_count(name: str) -> int:
    """Trainable parameters (tied embeddings counted once), from the shape alone.

    Gemma 3 per layer: q, k, v, o projections; gate, up, down MLP; four RMSNorms of the hidden
    width and the q/k RMSNorms of the head width; then the embedding and the final norm. No
    import of transformers, no model built: ``models``, ``doctor`` and ``join``'s fit check run
    in milliseconds. ``tests/test_models.py`` checks it equals the meta-built model's count
    for every registered model.
    """
    s = get_spec(name)
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * s.intermediate_size + 4 * h + 2 * s.head_dim
    return s.vocab_size * h + s.num_layers * per_layer + h
