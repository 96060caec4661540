"""Tests for p2pdiloco.train.data and p2pdiloco.train.tokenizer (CPU only, no network)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from p2pdiloco.train.data import (
    DataError,
    PackedCorpus,
    SourceStats,
    build_corpus,
    data_parallel_batches,
    eval_batches,
    iter_documents,
    learner_batches,
    learner_row_indices,
)
from p2pdiloco.train.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerUnavailable,
    load_tokenizer,
)

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "this",
    "data",
    "model",
    "learn",
    "peer",
]


def _make_corpus_dir(root: Path, num_docs: int = 40, words_per_doc: int = 400) -> Path:
    """Documents whose every line carries their own marker, e.g. 'DOC0007'."""
    rng = random.Random(1234)
    root.mkdir(parents=True, exist_ok=True)
    for d in range(num_docs):
        lines = []
        for _ in range(words_per_doc // 10):
            lines.append(f"DOC{d:04d} " + " ".join(rng.choice(WORDS) for _ in range(10)))
        (root / f"doc{d:04d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_corpus_dir(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def corpus(corpus_dir: Path) -> PackedCorpus:
    return build_corpus(str(corpus_dir), ByteTokenizer(), seq_len=64)


@pytest.fixture(scope="module")
def embedded() -> PackedCorpus:
    return build_corpus("embedded", ByteTokenizer(), seq_len=256)


def _one_line_error(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


# --- embedded corpus ------------------------------------------------------------------


def test_embedded_corpus_is_real_text(embedded: PackedCorpus) -> None:
    assert embedded.num_bytes > 2**20
    assert embedded.num_documents > 100
    assert embedded.train_NS.dtype == torch.long
    assert embedded.train_NS.shape[1] == 257
    assert embedded.num_eval_rows >= 8
    text = ByteTokenizer().decode(embedded.train_NS[:2000].flatten().tolist())
    assert "def " in text
    assert " the " in text and " and " in text


def test_embedded_fingerprint_stable(embedded: PackedCorpus) -> None:
    again = build_corpus("embedded", ByteTokenizer(), seq_len=256)
    assert again.fingerprint == embedded.fingerprint
    assert torch.equal(again.train_NS, embedded.train_NS)
    other = build_corpus("embedded", ByteTokenizer(), seq_len=128, max_bytes=2**20)
    assert other.fingerprint != embedded.fingerprint


def test_embedded_sources_include_topics_and_exclude_tests() -> None:
    names = [d.name for d in iter_documents("embedded", max_bytes=200_000)]
    assert names[0].startswith("pydoc_data/topics/")
    all_names = [d.name for d in iter_documents("embedded")]
    assert any(n.startswith("stdlib/") for n in all_names)
    for bad in ("/test/", "/tests/", "site-packages", "idlelib", "lib2to3", "__pycache__"):
        assert not any(bad in f"/{n}" for n in all_names), bad


def test_max_bytes_caps_the_source() -> None:
    stats = SourceStats()
    docs = list(iter_documents("embedded", max_bytes=50_000, stats=stats))
    assert sum(len(d.text.encode()) for d in docs) <= 50_000
    assert stats.truncated and stats.bytes <= 50_000


# --- sharding -------------------------------------------------------------------------


def _shard_args(**overrides: int) -> dict[str, int]:
    args = dict(seed=7, learner=0, num_learners=4, round=0, steps=3, batch_size=4)
    args.update(overrides)
    return args


def test_same_args_identical_batches(corpus: PackedCorpus) -> None:
    a = learner_batches(corpus, **_shard_args(learner=2, round=5))
    b = learner_batches(corpus, **_shard_args(learner=2, round=5))
    assert a.shape == (3, 4, 65)
    assert torch.equal(a, b)
    assert not torch.equal(a, learner_batches(corpus, **_shard_args(learner=2, round=6)))
    assert not torch.equal(a, learner_batches(corpus, **_shard_args(learner=2, seed=8, round=5)))


def test_learners_disjoint_within_round(corpus: PackedCorpus) -> None:
    n = corpus.num_train_rows
    for round_ in (0, 3, 11):
        sets = []
        for learner in range(4):
            idx_TB = learner_row_indices(n, **_shard_args(learner=learner, round=round_))
            batch = learner_batches(corpus, **_shard_args(learner=learner, round=round_))
            assert torch.equal(batch, corpus.train_NS[idx_TB])
            sets.append(set(idx_TB.flatten().tolist()))
            assert len(sets[-1]) == idx_TB.numel()
        for i in range(4):
            for j in range(i + 1, 4):
                assert not sets[i] & sets[j]


def test_rounds_walk_shard_without_repetition(corpus: PackedCorpus) -> None:
    n = corpus.num_train_rows
    num_learners, steps, batch = 2, 2, 5
    shard_len = n // num_learners  # learner 0 gets floor(n / 2) rows
    per_round = steps * batch
    full_rounds = shard_len // per_round
    seen: list[int] = []
    for r in range(full_rounds):
        args = _shard_args(num_learners=num_learners, steps=steps, batch_size=batch, round=r)
        seen.extend(learner_row_indices(n, **args).flatten().tolist())
    assert len(seen) == len(set(seen)) == full_rounds * per_round
    # Keep going past the shard's end: the next epoch reuses the same shard rows.
    later: list[int] = []
    for r in range(full_rounds, 2 * full_rounds + 1):
        args = _shard_args(num_learners=num_learners, steps=steps, batch_size=batch, round=r)
        later.extend(learner_row_indices(n, **args).flatten().tolist())
    shard = set(seen) | set(later)
    assert len(shard) == shard_len
    other = learner_row_indices(n, **_shard_args(num_learners=2, learner=1, steps=2, batch_size=5))
    assert not shard & set(other.flatten().tolist())


def test_too_many_learners_is_data_error(corpus: PackedCorpus) -> None:
    with pytest.raises(DataError) as excinfo:
        learner_batches(corpus, **_shard_args(num_learners=64, steps=100, batch_size=8))
    assert "too small" in _one_line_error(excinfo)


def test_data_parallel_matches_learners(corpus: PackedCorpus) -> None:
    args = dict(seed=3, num_learners=3, round=2, steps=4, batch_size=2)
    dp = data_parallel_batches(corpus, **args)
    assert dp.shape == (4, 6, 65)
    per_learner = [learner_batches(corpus, learner=i, **args) for i in range(3)]
    for t in range(4):
        assert torch.equal(dp[t], torch.cat([b[t] for b in per_learner], dim=0))


def test_batches_identical_across_processes(corpus_dir: Path, corpus: PackedCorpus) -> None:
    snippet = (
        "import hashlib, sys\n"
        "from p2pdiloco.train.data import build_corpus, learner_batches\n"
        "from p2pdiloco.train.tokenizer import ByteTokenizer\n"
        "c = build_corpus(sys.argv[1], ByteTokenizer(), seq_len=64)\n"
        "b = learner_batches(c, seed=7, learner=1, num_learners=4, round=9, steps=3,"
        " batch_size=4)\n"
        "print(c.fingerprint, hashlib.sha256(b.numpy().tobytes()).hexdigest())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", snippet, str(corpus_dir)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=60,
    ).stdout.split()
    batch = learner_batches(corpus, **_shard_args(learner=1, round=9))
    assert out == [corpus.fingerprint, hashlib.sha256(batch.numpy().tobytes()).hexdigest()]


# --- train/eval split -----------------------------------------------------------------


def _markers(rows_NS: torch.Tensor) -> set[str]:
    tok = ByteTokenizer()
    found: set[str] = set()
    for row in rows_NS.tolist():
        for word in tok.decode(row).split():
            if word.startswith("DOC") and len(word) == 7:
                found.add(word)
    return found


def test_eval_documents_never_in_train(corpus: PackedCorpus) -> None:
    assert corpus.num_eval_documents >= 1
    assert corpus.num_eval_rows >= 8
    assert corpus.num_documents == 40
    eval_docs, train_docs = _markers(corpus.eval_NS), _markers(corpus.train_NS)
    assert eval_docs and train_docs
    assert not eval_docs & train_docs


def test_eval_batches(corpus: PackedCorpus) -> None:
    batches = eval_batches(corpus, batch_size=3)
    assert torch.equal(torch.cat(batches), corpus.eval_NS)
    assert all(b.shape[0] == 3 for b in batches[:-1])
    assert len(eval_batches(corpus, batch_size=3, max_batches=2)) == 2


def test_single_file_splits_its_stream(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text(" ".join(WORDS) * 200, encoding="utf-8")
    c = build_corpus(str(path), ByteTokenizer(), seq_len=32)
    assert c.num_documents == 1
    assert c.num_eval_rows >= 8 and c.num_train_rows > 10 * c.num_eval_rows
    assert c.train_NS[0, 0].item() == ByteTokenizer.bos_id


# --- directory sources and errors -----------------------------------------------------


def test_directory_source_file_kinds(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha text", encoding="utf-8")
    (tmp_path / "notes").write_text("no extension", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_bytes(b"bad utf8 \xff here")
    (tmp_path / "skip.py").write_text("ignored", encoding="utf-8")
    (tmp_path / ".hidden.txt").write_text("hidden", encoding="utf-8")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "c.txt").write_text("hidden dir", encoding="utf-8")
    records = [{"text": "first"}, "not json", {"id": 1}, {"text": 5}, {"text": "second"}]
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    stats = SourceStats()
    docs = list(iter_documents(str(tmp_path), stats=stats))
    assert [d.name for d in docs] == ["a.txt", "data.jsonl:1", "data.jsonl:5", "notes", "sub/b.md"]
    assert [d.text for d in docs][:3] == ["alpha text", "first", "second"]
    assert "\ufffd" in docs[-1].text
    assert stats.skipped_records == 3


def _error_source(tmp_path: Path, case: str) -> Path:
    if case == "missing":
        return tmp_path / "missing"
    if case == "only_empty":
        (tmp_path / "a.txt").write_text(" \n", encoding="utf-8")
        (tmp_path / "b").write_text("", encoding="utf-8")
    if case == "bad_suffix":
        (tmp_path / "x.csv").write_text("a,b", encoding="utf-8")
        return tmp_path / "x.csv"
    return tmp_path


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "does not exist"),
        ("empty", "has no .txt, .md, .jsonl or extension-less files"),
        ("only_empty", "contains no text"),
        ("bad_suffix", "is not a .txt, .md, .jsonl or extension-less file"),
    ],
)
def test_source_errors(tmp_path: Path, case: str, expected: str) -> None:
    source = _error_source(tmp_path, case)
    with pytest.raises(DataError) as excinfo:
        build_corpus(str(source), ByteTokenizer(), seq_len=16)
    message = _one_line_error(excinfo)
    assert expected in message and f"'{source}'" in message


def test_broken_symlink_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("fine " * 100, encoding="utf-8")
    (tmp_path / "bad.txt").symlink_to(tmp_path / "nonexistent")
    with pytest.raises(DataError) as excinfo:
        build_corpus(str(tmp_path), ByteTokenizer(), seq_len=16)
    assert "bad.txt" in _one_line_error(excinfo)


def test_unreadable_file_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "good.txt").write_text("fine " * 100, encoding="utf-8")
    (tmp_path / "f.txt").write_text("secret", encoding="utf-8")
    real_read_bytes = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self.name == "f.txt":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(DataError) as excinfo:
        build_corpus(str(tmp_path), ByteTokenizer(), seq_len=16)
    assert _one_line_error(excinfo) == f"cannot read '{tmp_path / 'f.txt'}': Permission denied"


def test_hf_source_without_network_is_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(DataError) as excinfo:
        build_corpus("hf:no-such-org/no-such-dataset@train", ByteTokenizer(), seq_len=16)
    assert "hf:no-such-org/no-such-dataset" in _one_line_error(excinfo)
    assert time.monotonic() - start < 10


# --- tokenizers -----------------------------------------------------------------------


def test_byte_tokenizer_roundtrip() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)
    text = "héllo wörld ✓ 日本語"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"


def test_unknown_hub_tokenizer_fails_fast_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(TokenizerUnavailable) as excinfo:
        load_tokenizer("no-such-org/no-such-tokenizer", cache_dir=str(tmp_path))
    assert time.monotonic() - start < 10
    message = _one_line_error(excinfo)
    assert "'no-such-org/no-such-tokenizer'" in message and "--tokenizer byte" in message


def test_missing_local_tokenizer_path() -> None:
    with pytest.raises(TokenizerUnavailable) as excinfo:
        load_tokenizer("./no/such/tokenizer/dir")
    assert "does not exist" in _one_line_error(excinfo)


def test_local_hf_tokenizer(tmp_path: Path, corpus_dir: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[UNK]", "<s>", "</s>"]
    raw.train_from_iterator(
        [" ".join(WORDS), "hello world"], trainers.WordLevelTrainer(special_tokens=specials)
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.save_pretrained(str(tmp_path / "tok"))

    tok = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(tok, HFTokenizer)
    assert tok.name == str(tmp_path / "tok")
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3
    ids = tok.encode("hello world")
    assert len(ids) == 2 and tok.bos_id not in ids
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]).split() == ["hello", "world"]

    c = build_corpus(str(corpus_dir), tok, seq_len=16, max_bytes=20_000)
    assert c.tokenizer_name == tok.name
    assert int(c.train_NS.max()) < tok.vocab_size
    assert c.num_train_rows > 0 and c.num_eval_rows > 0


class _Clock:
    """A monotonic clock that moves 3 s on every reading: every check is past the interval."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 3.0
        return self.now


class _WordTokenizer:
    """Not a ByteTokenizer (so documents go through the batched encoder); encodes as one."""

    name = "words"

    def __init__(self) -> None:
        self._byte = ByteTokenizer()
        self.vocab_size, self.pad_id = self._byte.vocab_size, self._byte.pad_id
        self.bos_id, self.eos_id = self._byte.bos_id, self._byte.eos_id

    def encode(self, text: str) -> list[int]:
        return self._byte.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._byte.decode(ids)


def test_a_long_corpus_preparation_logs_its_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from p2pdiloco.train import data, sources

    for i in range(600):
        (tmp_path / f"doc{i:03d}.txt").write_text(f"document {i} " * 20)
    clock = _Clock()
    monkeypatch.setattr(sources.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(data.time, "monotonic", clock.monotonic)
    with caplog.at_level(logging.INFO, logger="p2pdiloco.train"):
        corpus = build_corpus(str(tmp_path), _WordTokenizer(), seq_len=16)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        ln.startswith("reading ") and " documents, " in ln and "MB so far" in ln for ln in lines
    )
    assert "tokenizing with words: 256 of 600 documents" in lines
    assert corpus.num_documents == 600


def test_a_tokenizer_download_says_it_starts_and_ends(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The hub path (no network here: ``from_pretrained`` stands in for the hub and its own
    per-file progress bars)."""
    import logging
    from types import SimpleNamespace

    import transformers

    from p2pdiloco.train import tokenizer as tk

    class Fake(SimpleNamespace):
        def __len__(self) -> int:
            return 300

    calls = []

    def from_pretrained(hub_id: str, **kw: object) -> Fake:
        calls.append(kw)
        if kw.get("local_files_only"):
            raise OSError("not in the local cache")
        return Fake(
            eos_token_id=1, sep_token_id=None, bos_token_id=2, cls_token_id=None, pad_token_id=None
        )

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(tk, "_hub_reachable", lambda *a, **k: True)
    with caplog.at_level(logging.INFO, logger="p2pdiloco.train.tokenizer"):
        tok = tk.load_tokenizer("google/some-tokenizer")
    lines = [r.getMessage() for r in caplog.records]
    assert tok.name == "google/some-tokenizer" and len(calls) == 2
    assert "downloading tokenizer 'google/some-tokenizer' from the Hugging Face hub" in lines[0]
    assert lines[1].startswith("tokenizer 'google/some-tokenizer' downloaded in ")
