"""Tokenizers for training: a dependency-free byte tokenizer and a Hugging Face wrapper.

`load_tokenizer` turns a user-facing spec ("byte", a local directory, or a hub id) into a
`Tokenizer`. Every failure to obtain a tokenizer surfaces as `TokenizerUnavailable` with a
one-line message meant to be printed by the CLI as-is; it never hangs on an unreachable hub.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlparse

from p2pdiloco.errors import UserError
from p2pdiloco.train.hf_import import import_transformers

log = logging.getLogger(__name__)

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerUnavailable",
    "load_tokenizer",
]

# Seconds we are willing to wait to learn whether the hub is reachable at all. DNS lookups
# can block for far longer than any socket timeout, so the probe runs in a daemon thread.
_HUB_PROBE_TIMEOUT_S = 3.0


class TokenizerUnavailable(UserError):
    """The requested tokenizer cannot be loaded; the message is one user-facing line."""


@runtime_checkable
class Tokenizer(Protocol):
    """What training needs from a tokenizer. `encode` adds no special tokens."""

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, then pad=256, bos=257, eos=258.

    Never fails: `decode` drops special or out-of-range ids and replaces invalid UTF-8.
    """

    name: str = "byte"
    vocab_size: int = 259
    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A `transformers` tokenizer behind the `Tokenizer` protocol.

    `bos_id`/`eos_id`/`pad_id` fall back on one another because many LMs define only some
    of them (GPT-2 has a single <|endoftext|>). Raises `TokenizerUnavailable` at
    construction if the tokenizer defines none of bos/eos/sep, since documents could then
    not be delimited.
    """

    def __init__(self, tokenizer: Any, name: str) -> None:
        self._tok = tokenizer
        self.name = name
        self.vocab_size = int(len(tokenizer))
        eos = _first_not_none(tokenizer.eos_token_id, tokenizer.sep_token_id)
        bos = _first_not_none(tokenizer.bos_token_id, tokenizer.cls_token_id, eos)
        eos = _first_not_none(eos, bos)
        if eos is None or bos is None:
            raise TokenizerUnavailable(
                f"tokenizer '{name}' defines no bos/eos token, so documents cannot be "
                "delimited; use a tokenizer with an eos token or --tokenizer byte"
            )
        self.bos_id = int(bos)
        self.eos_id = int(eos)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False, verbose=False)["input_ids"])

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (fast tokenizers parallelise this in Rust)."""
        if not texts:
            return []
        out = self._tok(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [list(ids) for ids in out]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def _first_not_none(*values: int | None) -> int | None:
    for v in values:
        if v is not None:
            return v
    return None


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_reachable(timeout_s: float = _HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub endpoint opens within `timeout_s` seconds."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname
    if not host:
        return False
    port = url.port or (80 if url.scheme == "http" else 443)
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="hf-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(result and result[0])


def _from_local_path(path: str) -> HFTokenizer:
    try:
        if os.path.isfile(path):
            import_transformers()
            from transformers import PreTrainedTokenizerFast

            tok: Any = PreTrainedTokenizerFast(tokenizer_file=path)
        else:
            import_transformers()
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise TokenizerUnavailable(
            f"cannot load tokenizer from '{path}': {_one_line(exc)}"
        ) from exc
    return HFTokenizer(tok, name=path)


def _from_hub(hub_id: str, cache_dir: str | None) -> HFTokenizer:
    import_transformers()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(hub_id, cache_dir=cache_dir, local_files_only=True)
        return HFTokenizer(tok, name=hub_id)
    except TokenizerUnavailable:
        raise
    except Exception as exc:
        cache_error: Exception = exc

    hint = "pass --tokenizer PATH to a local tokenizer directory or use --tokenizer byte"
    if _env_true("HF_HUB_OFFLINE") or not _hub_reachable():
        raise TokenizerUnavailable(
            f"tokenizer '{hub_id}' is not in the local Hugging Face cache and the hub is "
            f"unreachable (offline?); {hint}"
        ) from cache_error
    # Progress: this line, then the hub's own per-file bars on stderr, then the line after.
    log.info("downloading tokenizer '%s' from the Hugging Face hub (first use only)", hub_id)
    started = time.monotonic()
    try:
        tok = AutoTokenizer.from_pretrained(hub_id, cache_dir=cache_dir)
        log.info("tokenizer '%s' downloaded in %.1f s", hub_id, time.monotonic() - started)
    except Exception as exc:
        raise TokenizerUnavailable(
            f"tokenizer '{hub_id}' could not be loaded from the Hugging Face hub "
            f"({_one_line(exc)}); {hint}"
        ) from exc
    return HFTokenizer(tok, name=hub_id)


def load_tokenizer(spec: str, *, cache_dir: str | None = None) -> Tokenizer:
    """Load the tokenizer named by `spec`.

    `spec` is "byte" (`ByteTokenizer`), an existing local path (a tokenizer directory or a
    `tokenizer.json` file), or a Hugging Face hub id. A hub id is looked up in the local
    cache first; the network is tried only if that fails, `HF_HUB_OFFLINE` is not set and
    the hub answers within a few seconds. Raises `TokenizerUnavailable` (one-line message)
    on any failure.
    """
    spec = spec.strip()
    if not spec:
        raise TokenizerUnavailable("empty tokenizer spec; use --tokenizer byte or a path")
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.expanduser(spec)
    if os.path.exists(path):
        return _from_local_path(path)
    # Hub ids are "name" or "org/name"; anything else is clearly meant as a local path.
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or os.sep != "/" and os.sep in spec:
        raise TokenizerUnavailable(f"tokenizer path '{spec}' does not exist")
    return _from_hub(spec, cache_dir)
