"""Training data: document sources, packing into fixed-length rows, deterministic sharding.

Every learner builds the same `PackedCorpus` from the same source and compares
`fingerprint`s; the sharding functions are then pure functions of their arguments, so peers
agree on who reads which rows without exchanging any data.

Tensor legend:
    N  packed rows (sequences)
    S  tokens per row = seq_len + 1 (model inputs plus the one-token-shifted targets)
    B  rows per learner per step (batch size)
    T  inner steps in one round
    L  learners
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

import numpy as np
import torch

from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.train.sources import (
    DEFAULT_MAX_BYTES,
    PROGRESS_EVERY,
    DataError,
    Document,
    SourceStats,
    describe_source,
    iter_documents,
)
from p2pdiloco.train.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DataError",
    "Document",
    "PackedCorpus",
    "SourceStats",
    "assigned_rows",
    "sample_rows",
    "build_corpus",
    "data_parallel_batches",
    "eval_batches",
    "held_out_batches",
    "eval_fraction_of",
    "iter_documents",
    "learner_batches",
    "learner_row_indices",
]

log = logging.getLogger(__name__)

# Share of documents in the eval split unless a run's held-out split names another (ADR 0059).
DEFAULT_EVAL_FRACTION = 0.05


@dataclass
class PackedCorpus:
    """Token rows of S = seq_len + 1 tokens, split into train and eval by document.

    `fingerprint` covers the documents, the tokenizer name and every parameter that shapes
    the rows, so equal fingerprints on two machines mean equal `train_NS`/`eval_NS`
    (given the same tokenizer files).
    """

    train_NS: torch.Tensor
    eval_NS: torch.Tensor
    seq_len: int
    fingerprint: str
    num_documents: int
    num_tokens: int
    source: str
    tokenizer_name: str
    num_eval_documents: int = 0
    num_bytes: int = 0
    skipped_records: int = 0
    truncated: bool = False

    @property
    def num_train_rows(self) -> int:
        return int(self.train_NS.shape[0])

    @property
    def num_eval_rows(self) -> int:
        return int(self.eval_NS.shape[0])

    @property
    def train_tokens(self) -> int:
        return int(self.train_NS.numel())

    @property
    def eval_tokens(self) -> int:
        return int(self.eval_NS.numel())

    def summary(self) -> str:
        return (
            f"{describe_source(self.source)}: {self.num_documents} documents, "
            f"{self.num_bytes / 2**20:.1f} MiB, {self.num_tokens} tokens ({self.tokenizer_name}) "
            f"-> {self.num_train_rows} train / {self.num_eval_rows} eval rows of "
            f"{self.seq_len + 1}, fingerprint {self.fingerprint[:12]}"
        )


def _fingerprint(docs: Sequence[Document], encoded: Sequence[bytes], params: tuple) -> str:
    h = hashlib.sha256()
    h.update(repr(("p2pdiloco-corpus-v1",) + params).encode())
    for doc, data in zip(docs, encoded, strict=True):
        name = doc.name.encode("utf-8")
        # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
        h.update(len(name).to_bytes(8, "little") + name + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _unit_hash(name: str) -> float:
    """A uniform-looking number in [0, 1) that depends only on `name`."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _assign_eval(
    names: Sequence[str], lengths: Sequence[int], S: int, eval_fraction: float, min_rows: int
) -> list[bool]:
    """Which documents go to eval: hash below `eval_fraction`, then more in hash order
    until eval fills `min_rows` rows, never taking the last train document nor more
    tokens than train keeps."""
    if eval_fraction <= 0:
        return [False] * len(names)
    keys = [_unit_hash(n) for n in names]
    order = sorted(range(len(names)), key=lambda i: (keys[i], names[i]))
    is_eval = [k < eval_fraction for k in keys]
    if all(is_eval):
        is_eval[order[-1]] = False
    eval_tokens = sum(n for n, e in zip(lengths, is_eval, strict=True) if e)
    train_tokens = sum(lengths) - eval_tokens
    train_docs = is_eval.count(False)
    for i in order:
        if eval_tokens // S >= min_rows:
            break
        if is_eval[i] or train_docs <= 1 or train_tokens - lengths[i] < eval_tokens + lengths[i]:
            continue
        is_eval[i] = True
        eval_tokens += lengths[i]
        train_tokens -= lengths[i]
        train_docs -= 1
    return is_eval


def _byte_stream(encoded: Sequence[bytes], tok: ByteTokenizer) -> torch.Tensor:
    """bos + bytes + eos per document, concatenated, without a Python loop per byte."""
    if not encoded:
        return torch.empty(0, dtype=torch.long)
    lengths = torch.tensor([len(e) for e in encoded], dtype=torch.long)
    total = int(lengths.sum()) + 2 * len(encoded)
    # Document i starts after all earlier documents and their two special tokens.
    starts = torch.cumsum(lengths + 2, 0) - (lengths + 2)
    ends = starts + lengths + 1
    stream = torch.empty(total, dtype=torch.long)
    content = torch.ones(total, dtype=torch.bool)
    content[starts] = False
    content[ends] = False
    stream[starts] = tok.bos_id
    stream[ends] = tok.eos_id
    joined = b"".join(encoded)
    if joined:
        stream[content] = torch.frombuffer(bytearray(joined), dtype=torch.uint8).long()
    return stream


def _token_stream(ids: Sequence[list[int]], tokenizer: Tokenizer) -> torch.Tensor:
    bos, eos = [tokenizer.bos_id], [tokenizer.eos_id]
    return torch.tensor(list(chain.from_iterable(bos + d + eos for d in ids)), dtype=torch.long)


def _pack(stream: torch.Tensor, S: int) -> torch.Tensor:
    rows = stream.shape[0] // S
    return stream[: rows * S].reshape(rows, S).clone()


def _encode_all(texts: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Every text's token ids, in batches of 256 documents; a long run logs its progress every
    couple of seconds."""
    batch = getattr(tokenizer, "encode_batch", None)
    out: list[list[int]] = []
    said = time.monotonic()
    for start in range(0, len(texts), 256):
        part = texts[start : start + 256]
        out += (
            [list(ids) for ids in batch(part)]
            if callable(batch)
            else [tokenizer.encode(t) for t in part]
        )
        if time.monotonic() - said >= PROGRESS_EVERY and len(out) < len(texts):
            said = time.monotonic()
            log.info("tokenizing with %s: %d of %d documents", tokenizer.name, len(out), len(texts))
    return out


def build_corpus(
    source: str,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    max_bytes: int = DEFAULT_MAX_BYTES,
    min_eval_sequences: int = 8,
) -> PackedCorpus:
    """Read `source`, tokenize it and pack it into train/eval rows of seq_len + 1 tokens.

    Documents go to eval by a hash of their name (see `_assign_eval`); a single-document
    source instead gives the tail of its token stream to eval. Each document is
    bos + tokens + eos; a split's documents are concatenated and cut into rows, dropping
    the tail. Raises `DataError` for any source problem (see `iter_documents`) or when
    fewer than one training row results; `ValueError` for invalid parameters.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if min_eval_sequences < 0:
        raise ValueError(f"min_eval_sequences must be >= 0, got {min_eval_sequences}")
    S = seq_len + 1
    stats = SourceStats()
    docs = list(iter_documents(source, max_bytes=max_bytes, stats=stats))
    encoded = [d.text.encode("utf-8") for d in docs]
    params = (
        tokenizer.name,
        tokenizer.vocab_size,
        seq_len,
        repr(eval_fraction),
        min_eval_sequences,
    )
    fingerprint = _fingerprint(docs, encoded, params)

    byte_tok = tokenizer if isinstance(tokenizer, ByteTokenizer) else None
    ids: list[list[int]] = [] if byte_tok else _encode_all([d.text for d in docs], tokenizer)
    lengths = [len(e) + 2 for e in encoded] if byte_tok else [len(i) + 2 for i in ids]

    def stream_of(selected: list[int]) -> torch.Tensor:
        if byte_tok is not None:
            return _byte_stream([encoded[i] for i in selected], byte_tok)
        return _token_stream([ids[i] for i in selected], tokenizer)

    if len(docs) == 1:
        stream = stream_of([0])
        rows = stream.shape[0] // S
        eval_rows = 0
        if eval_fraction > 0 and rows >= 2:
            eval_rows = min(max(math.ceil(rows * eval_fraction), min_eval_sequences), rows // 2)
        cut = (rows - eval_rows) * S
        train_NS, eval_NS = _pack(stream[:cut], S), _pack(stream[cut:], S)
        num_eval_docs = 0
    else:
        is_eval = _assign_eval(
            [d.name for d in docs], lengths, S, eval_fraction, min_eval_sequences
        )
        train_NS = _pack(stream_of([i for i, e in enumerate(is_eval) if not e]), S)
        eval_NS = _pack(stream_of([i for i, e in enumerate(is_eval) if e]), S)
        num_eval_docs = sum(is_eval)

    num_tokens = sum(lengths)
    if train_NS.shape[0] < 1:
        raise DataError(
            f"{describe_source(source)} is too small: {num_tokens} tokens do not fill one "
            f"training row of {S} tokens; use a smaller --seq-len or more data"
        )
    return PackedCorpus(
        train_NS=train_NS,
        eval_NS=eval_NS,
        seq_len=seq_len,
        fingerprint=fingerprint,
        num_documents=len(docs),
        num_tokens=num_tokens,
        source=source,
        tokenizer_name=tokenizer.name,
        num_eval_documents=num_eval_docs,
        num_bytes=stats.bytes,
        skipped_records=stats.skipped_records,
        truncated=stats.truncated,
    )


def _derive_seed(*parts: object) -> int:
    """A 64-bit seed from a tuple of ints/strings; unlike hash(), identical in any process."""
    digest = hashlib.sha256(repr(("p2pdiloco.data",) + parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


@lru_cache(maxsize=16)
def _permutation(n: int, seed: int) -> torch.Tensor:
    """A pseudo-random permutation of range(n).

    Sorting splitmix64 hashes rather than calling torch.randperm keeps the result identical
    across torch versions and platforms, which peers with different installs rely on.
    The cached tensor is shared: callers must not modify it.
    """
    z = np.uint64(seed) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return torch.from_numpy(np.argsort(z, kind="stable").astype(np.int64))


def learner_row_indices(
    num_rows: int,
    *,
    seed: int,
    learner: int,
    num_learners: int,
    round: int,
    steps: int,
    batch_size: int,
) -> torch.Tensor:
    """Train-row indices [T, B] that `learner` reads in `round`; a pure function.

    Rows are permuted globally by `seed` and cut into `num_learners` contiguous, disjoint
    shards. A learner walks a per-epoch permutation of its shard (seeded by seed, learner,
    epoch), `steps * batch_size` rows per round, so rows repeat only after the shard is
    exhausted. Raises `DataError` if `num_learners * steps * batch_size > num_rows` (the
    learners could not read disjoint rows), `ValueError` for invalid arguments.
    """
    if num_learners < 1 or not 0 <= learner < num_learners:
        raise ValueError(f"need 0 <= learner < num_learners, got {learner}, {num_learners}")
    if round < 0 or steps < 1 or batch_size < 1:
        raise ValueError(
            f"need round >= 0, steps >= 1, batch_size >= 1: {round, steps, batch_size}"
        )
    per_round = steps * batch_size
    if per_round * num_learners > num_rows:
        raise DataError(
            f"corpus too small: {num_rows} training rows cannot give {num_learners} learners "
            f"x {steps} steps x {batch_size} rows ({per_round * num_learners}) disjoint rows "
            "per round; use fewer steps, a smaller batch or more data"
        )
    lo = learner * num_rows // num_learners
    hi = (learner + 1) * num_rows // num_learners
    shard = _permutation(num_rows, _derive_seed("global", seed))[lo:hi]
    positions = torch.arange(round * per_round, (round + 1) * per_round, dtype=torch.long)
    epochs = positions // shard.shape[0]
    offsets = positions % shard.shape[0]
    rows_TB = torch.empty(per_round, dtype=torch.long)
    # per_round <= shard length, so one round spans at most two epochs.
    for epoch in torch.unique(epochs).tolist():
        order = _permutation(
            int(shard.shape[0]), _derive_seed("epoch", seed, num_learners, learner, epoch)
        )
        mask = epochs == epoch
        rows_TB[mask] = shard[order[offsets[mask]]]
    return rows_TB.reshape(steps, batch_size)


def assigned_rows(
    num_rows: int, *, seed: int, version: int, steps: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The train rows assigned to the network learner whose data seed is `seed` for its
    stretch from certified `version` (``learner_row_indices`` with one learner, round =
    `version`: ``Learner.train`` reads exactly these), and every other row. A pure function,
    so a committee knows which rows a delta was trained on (``sync.scoring``, ADR 0062)."""
    own = learner_row_indices(
        num_rows,
        seed=seed,
        learner=0,
        num_learners=1,
        round=version,
        steps=steps,
        batch_size=batch_size,
    ).reshape(-1)
    mask = torch.ones(num_rows, dtype=torch.bool)
    mask[own] = False
    return own, torch.nonzero(mask).squeeze(1)


def sample_rows(rows: torch.Tensor, count: int, *parts: object) -> torch.Tensor:
    """``count`` of ``rows`` (all when fewer) in an order seeded by ``parts``: a pure
    function, the same on every machine (the committee's scoring batches)."""
    order = _permutation(int(rows.shape[0]), _derive_seed("sample", *parts))
    return rows[order[:count]]


def learner_batches(
    corpus: PackedCorpus,
    *,
    seed: int,
    learner: int,
    num_learners: int,
    round: int,
    steps: int,
    batch_size: int,
) -> torch.Tensor:
    """Rows [T, B, S] that `learner` trains on in `round`; see `learner_row_indices`."""
    rows_TB = learner_row_indices(
        corpus.num_train_rows,
        seed=seed,
        learner=learner,
        num_learners=num_learners,
        round=round,
        steps=steps,
        batch_size=batch_size,
    )
    return corpus.train_NS[rows_TB]


def data_parallel_batches(
    corpus: PackedCorpus,
    *,
    seed: int,
    num_learners: int,
    round: int,
    steps: int,
    batch_size: int,
) -> torch.Tensor:
    """Rows [T, L*B, S]: step t holds step t of learners 0..L-1 in order, so a
    data-parallel baseline trains on exactly the tokens the learners read that round."""
    rows_LTB = torch.stack(
        [
            learner_row_indices(
                corpus.num_train_rows,
                seed=seed,
                learner=i,
                num_learners=num_learners,
                round=round,
                steps=steps,
                batch_size=batch_size,
            )
            for i in range(num_learners)
        ]
    )
    rows_TLB = rows_LTB.transpose(0, 1).reshape(steps, num_learners * batch_size)
    return corpus.train_NS[rows_TLB]


def eval_batches(
    corpus: PackedCorpus, *, batch_size: int, max_batches: int | None = None
) -> list[torch.Tensor]:
    """Eval rows in order as [B, S] batches (the last may be smaller); empty if no eval."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batches = list(torch.split(corpus.eval_NS, batch_size))
    return batches if max_batches is None else batches[:max_batches]


def held_out_batches(
    corpus: PackedCorpus, *, seed: int, batches: int, batch_size: int
) -> list[torch.Tensor]:
    """The fixed, seeded eval batches a run's committees evaluate every certified state on
    (``RunManifest.held_out``, ADR 0059): ``batches`` [B, S] batches of eval rows drawn without
    repeats by a permutation of ``seed`` (fewer rows if the split holds fewer), the same on
    every machine (``_permutation``); empty if the corpus has no eval rows."""
    if batches < 1 or batch_size < 1:
        raise ValueError(f"need batches >= 1 and batch_size >= 1, got {batches}, {batch_size}")
    n = corpus.num_eval_rows
    if n == 0:
        return []
    rows = _permutation(n, _derive_seed("held-out", seed))[: batches * batch_size]
    return list(torch.split(corpus.eval_NS[rows], batch_size))


def eval_fraction_of(manifest: RunManifest) -> float:
    """``build_corpus``'s eval fraction for a run: the one its manifest names
    (``RunManifest.held_out``), or the default split for a run without one."""
    return DEFAULT_EVAL_FRACTION if manifest.held_out is None else manifest.held_out.fraction
