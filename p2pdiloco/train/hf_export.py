"""A model's parameters as a Hugging Face directory, its tokenizer included, and text from it.

``save_hf_dir`` writes what ``transformers.AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load: ``config.json`` (the run model's ``Gemma3TextConfig``),
``model.safetensors`` (fp32, the tied output head once), ``generation_config.json`` and the
tokenizer files. The byte tokenizer of the small members (``train.tokenizer.ByteTokenizer``)
is written as a ``tokenizers`` byte-level model with the same ids: bytes 0..255, then
``<pad>`` 256, ``<bos>`` 257, ``<eos>`` 258 and ``<unused0..4>`` up to the model's 264
embeddings. Calling it with its default ``add_special_tokens=True`` prepends ``<bos>``, as
every training document starts; literal "<eos>" in a text stays five bytes, as in training.
Published members export the tokenizer they were trained with (``ModelSpec.tokenizer``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.train.hf_import import building_models, import_transformers
from p2pdiloco.train.model_specs import get_spec
from p2pdiloco.train.models import build_for_loading, param_state
from p2pdiloco.train.tokenizer import ByteTokenizer, TokenizerUnavailable, load_tokenizer

_BYTE = ByteTokenizer()
_SPECIALS = {"<pad>": _BYTE.pad_id, "<bos>": _BYTE.bos_id, "<eos>": _BYTE.eos_id}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in of each byte: the alphabet of the ByteLevel pre-tokenizer."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(kept, chars, strict=True)}


def byte_tokenizer_fast(vocab_size: int = 264) -> Any:
    """The byte tokenizer as a ``transformers`` fast tokenizer with ``ByteTokenizer``'s ids,
    padded with ``<unusedN>`` tokens to ``vocab_size`` entries."""
    import_transformers()
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    unused = [f"<unused{i}>" for i in range(vocab_size - 256 - len(_SPECIALS))]
    tok.add_special_tokens([AddedToken(t, special=True) for t in [*_SPECIALS, *unused]])
    assert tok.token_to_id("<eos>") == _BYTE.eos_id and tok.get_vocab_size() == vocab_size
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", _BYTE.bos_id)]
    )
    # Special tokens are never matched in text: "<eos>" written in a document is its bytes.
    tok.encode_special_tokens = True
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        split_special_tokens=True,
    )


def hf_tokenizer(model: str) -> Any:
    """The ``transformers`` tokenizer the run model ``model`` trains with. Raises
    TokenizerUnavailable (one line) for a published member whose tokenizer is neither in the
    local Hugging Face cache nor downloadable."""
    spec = get_spec(model)
    if spec.tokenizer == "byte":
        return byte_tokenizer_fast(spec.vocab_size)
    import_transformers()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec.tokenizer, local_files_only=True)
    except Exception:  # not cached: fetch it the way training does (one-line errors)
        load_tokenizer(spec.tokenizer)
    try:
        return AutoTokenizer.from_pretrained(spec.tokenizer, local_files_only=True)
    except Exception as e:
        raise TokenizerUnavailable(f"cannot load tokenizer '{spec.tokenizer}': {e}") from None


def model_from_params(model: str, params: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The run model ``model`` holding ``params`` (a certified state's parameters), in eval
    mode on the CPU. Raises KeyError if a parameter is missing."""
    net = build_for_loading(model)
    with torch.no_grad():
        for name, p in param_state(net).items():
            p.copy_(params[name].to(p.dtype))
    return net.eval()


def save_hf_dir(model: str, params: Mapping[str, torch.Tensor], out: Path, card: str) -> None:
    """Write ``params`` of run model ``model`` as a Hugging Face directory at ``out`` (created;
    it must not hold files), with its tokenizer and ``card`` as ``README.md``."""
    import_transformers()
    from transformers.utils import logging as hf_logging

    net: Any = model_from_params(model, params)  # a Gemma3ForCausalLM
    # Training turns the cache off; whoever generates from the export wants it.
    net.config.use_cache = net.generation_config.use_cache = True
    tokenizer = hf_tokenizer(model)
    if get_spec(model).tokenizer == "byte":
        tokenizer.model_max_length = net.config.max_position_embeddings
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()  # the command prints its own one-line summary
    net.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / "README.md").write_text(card, encoding="utf-8")
    if get_spec(model).tokenizer == "byte":
        _plain_tokenizer_class(out / "tokenizer_config.json")


def _plain_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class every transformers release knows (5 writes its own
    ``TokenizersBackend``, which 4.x cannot load; both load ``PreTrainedTokenizerFast``)."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_hf_dir(path: Path) -> tuple[torch.nn.Module, Any]:
    """The causal LM and tokenizer of an exported directory (``save_hf_dir``), in eval mode."""
    import_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with building_models():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(path))


@torch.no_grad()
def sample(
    model: Any,
    tokenizer: Any,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> str:
    """The text ``model`` (a transformers causal LM) continues ``prompt`` with (a document's start: ``<bos>`` first), up to
    ``max_new_tokens`` tokens or the end of a document. ``temperature`` 0 is greedy; above 0
    samples, from the ``top_k`` likeliest tokens when ``top_k`` > 0, reproducibly for ``seed``."""
    enc = tokenizer(prompt, return_tensors="pt")
    eos = tokenizer.eos_token_id
    args: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        args |= {"temperature": temperature, "top_k": top_k}  # top_k 0: every token
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
            use_cache=True,
            **args,
        )
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    return str(tokenizer.decode(new, skip_special_tokens=True))
