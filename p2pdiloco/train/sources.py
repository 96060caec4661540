"""Document sources: the embedded corpus, text directories and files, Hugging Face datasets.

Each source yields `Document`s in a deterministic order; `iter_documents` caps the total bytes
and turns every problem with the source into a one-line `DataError`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from p2pdiloco.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 16 * 2**20
# A data file is judged text or not by its first bytes: any NUL byte, or more than this share
# of the sample undecodable as UTF-8, means a binary (an executable, an archive, random bytes;
# random bytes are about half invalid). Text in a legacy 8-bit encoding stays well below it and
# is read with its odd bytes replaced.
_SNIFF_BYTES = 8192
_MAX_BAD_UTF8 = 0.25
_TEXT_SUFFIXES = (".txt", ".md", ".jsonl")
# pydoc_data/topics.py is a repr() of the pydoc topics we already include verbatim.
_EMBEDDED_EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "ensurepip",
        "__pycache__",
        "pydoc_data",
    }
)


class DataError(UserError):
    """A user-facing data problem; the message is one line (the CLI prints it, exits 2)."""


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass
class SourceStats:
    """Filled in by `iter_documents` while it runs."""

    documents: int = 0
    bytes: int = 0
    skipped_records: int = 0
    truncated: bool = False


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _usable_name(name: str) -> bool:
    return not name.startswith(".") and (
        name.endswith(_TEXT_SUFFIXES) or os.path.splitext(name)[1] == ""
    )


def _read_text(path: Path) -> str:
    """Read a file as UTF-8 (invalid bytes replaced); DataError naming it if unreadable."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read '{path}': {exc.strerror or _one_line(exc)}") from exc
    return data.decode("utf-8-sig", errors="replace")


def _not_text(data: bytes) -> str | None:
    """Why ``data`` (a file's first bytes) is not text, or None if it looks like UTF-8 text."""
    sample = data[:_SNIFF_BYTES]
    if b"\x00" in sample:
        return "it holds NUL bytes, as binaries do"
    # A multi-byte character cut at the sample's end is not an error: drop up to 3 tail bytes.
    decoded = sample.decode("utf-8", errors="replace")
    bad = max(0, decoded.count("\ufffd") - (3 if len(data) > len(sample) else 0))
    if bad >= 4 and bad / len(sample) > _MAX_BAD_UTF8:
        return f"{bad / len(sample):.0%} of its first {len(sample)} bytes are not UTF-8"
    return None


def _refuse_binary(path: Path) -> None:
    """DataError naming ``path`` if its first bytes are not text, or if it cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES + 4)
    except OSError as exc:
        raise DataError(f"cannot read '{path}': {exc.strerror or _one_line(exc)}") from exc
    if (why := _not_text(head)) is not None:
        raise DataError(
            f"data file '{path}' is not text ({why}); pass UTF-8 text (.txt, .md, .jsonl or "
            "extension-less files), a directory of them, or hf:NAME"
        )


def _file_documents(path: Path, rel: str, stats: SourceStats) -> Iterator[Document]:
    _refuse_binary(path)
    text = _read_text(path)
    if not rel.endswith(".jsonl"):
        yield Document(rel, text)
        return
    # split("\n"), not splitlines(): JSON strings may legally contain raw U+2028 etc.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            yield Document(f"{rel}:{lineno}", record["text"])
        else:
            stats.skipped_records += 1


def _list_files(
    root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]
) -> list[tuple[str, Path]]:
    """(relative posix path, path) of kept files under `root`, sorted by relative path.

    Raises `DataError` naming any directory that cannot be listed."""

    def on_error(exc: OSError) -> None:
        raise DataError(f"cannot read '{exc.filename}': {exc.strerror or _one_line(exc)}") from exc

    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=on_error):
        dirnames[:] = [d for d in dirnames if keep_dir(d)]
        for name in filenames:
            path = Path(dirpath) / name
            # Broken symlinks are kept so that reading them reports the problem by name.
            if keep_file(name) and (path.is_symlink() or path.is_file()):
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def _path_documents(source: str, stats: SourceStats) -> Iterator[Document]:
    root = Path(os.path.expanduser(source))
    kind = "file" if source.endswith(_TEXT_SUFFIXES) else "directory"
    if not root.exists() and not root.is_symlink():
        raise DataError(f"data {kind} '{source}' does not exist")
    if root.is_dir():
        files = _list_files(root, lambda d: not d.startswith("."), _usable_name)
        if not files:
            raise DataError(
                f"data directory '{source}' has no .txt, .md, .jsonl or extension-less files"
            )
    elif _usable_name(root.name):
        _refuse_binary(root)  # now, before the caller starts any work
        files = [(root.name, root)]
    else:
        raise DataError(f"data file '{source}' is not a .txt, .md, .jsonl or extension-less file")

    def generate() -> Iterator[Document]:
        for rel, path in files:
            yield from _file_documents(path, rel, stats)

    return generate()


def _embedded_documents() -> Iterator[Document]:
    """Python's own docs topics (first, so a small cap keeps them) then stdlib sources."""
    topics: dict[str, str] = {}
    try:
        import pydoc_data.topics

        topics = dict(pydoc_data.topics.topics)
    except ImportError:  # some distributions strip pydoc_data
        pass
    for key in sorted(topics):
        yield Document(f"pydoc_data/topics/{key}", topics[key])
    # An odd unreadable stdlib file or directory must not break the default corpus.
    sources: list[tuple[str, Path]] = []
    with contextlib.suppress(DataError):
        sources = _list_files(
            Path(sysconfig.get_paths()["stdlib"]),
            lambda d: d not in _EMBEDDED_EXCLUDED_DIRS,
            lambda f: f.endswith(".py"),
        )
    for rel, path in sources:
        try:
            text = _read_text(path)
        except DataError:
            continue
        yield Document(f"stdlib/{rel}", text)


def _hf_documents(source: str, stats: SourceStats) -> Iterator[Document]:
    spec, _, split = source[len("hf:") :].partition("@")
    name, _, config = spec.partition(":")
    split = split or "train"
    if not name:
        raise DataError(f"bad source '{source}': expected hf:NAME[:CONFIG][@SPLIT]")
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            f"source '{source}' needs the 'datasets' package: pip install 'p2pdiloco[hf]'"
        ) from exc
    try:
        dataset = datasets.load_dataset(name, config or None, split=split, streaming=True)
    except Exception as exc:
        raise DataError(f"cannot load Hugging Face dataset '{source}': {_one_line(exc)}") from exc

    def generate() -> Iterator[Document]:
        try:
            for i, record in enumerate(dataset):
                text = record.get("text") if isinstance(record, dict) else None
                if isinstance(text, str):
                    yield Document(f"{source}/{i}", text)
                else:
                    stats.skipped_records += 1
        except Exception as exc:
            raise DataError(
                f"error reading Hugging Face dataset '{source}': {_one_line(exc)}"
            ) from exc

    return generate()


def describe_source(source: str) -> str:
    if source == "embedded":
        return "the embedded corpus"
    if source.startswith("hf:"):
        return f"dataset '{source}'"
    return f"data {'directory' if os.path.isdir(source) else 'file'} '{source}'"


PROGRESS_EVERY = 2.0  # seconds between progress lines of a long read or tokenization


def _capped(
    documents: Iterator[Document], source: str, max_bytes: int, stats: SourceStats
) -> Iterator[Document]:
    said = time.monotonic()
    for doc in documents:
        if time.monotonic() - said >= PROGRESS_EVERY:  # a long read says how far it got
            said = time.monotonic()
            log.info(
                "reading %s: %d documents, %.1f MB so far (at most %.0f MB)",
                describe_source(source),
                stats.documents,
                stats.bytes / 1e6,
                max_bytes / 1e6,
            )
        if not doc.text.strip():
            continue
        data = doc.text.encode("utf-8")
        room = max_bytes - stats.bytes
        if len(data) >= room:
            stats.truncated = len(data) > room
            doc = Document(doc.name, data[:room].decode("utf-8", errors="ignore"))
            data = doc.text.encode("utf-8")
        if doc.text.strip():
            stats.documents += 1
            stats.bytes += len(data)
            yield doc
        if stats.bytes >= max_bytes:
            break
    if stats.skipped_records:
        log.warning("%s: skipped %d records without a text field", source, stats.skipped_records)
    if stats.documents == 0:
        raise DataError(f"{describe_source(source)} contains no text")


def iter_documents(
    source: str, *, max_bytes: int = DEFAULT_MAX_BYTES, stats: SourceStats | None = None
) -> Iterator[Document]:
    """Yield the non-empty documents of `source`, at most `max_bytes` UTF-8 bytes in all.

    `source` is "embedded", "hf:NAME[:CONFIG][@SPLIT]", a directory or a single file. The
    document that crosses the cap is truncated and iteration stops. Missing paths, empty
    directories and unusable specs raise `DataError` here, eagerly; unreadable files and
    a source without any text raise `DataError` during iteration. A file that is not text (NUL
    bytes, or mostly invalid UTF-8 in its first 8 KiB) is refused with `DataError`: eagerly for
    a single file, when it is reached for a file in a directory. Malformed .jsonl lines
    are skipped and counted in `stats.skipped_records`.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    stats = stats if stats is not None else SourceStats()
    if source == "embedded":
        documents = _embedded_documents()
    elif source.startswith("hf:"):
        documents = _hf_documents(source, stats)
    else:
        documents = _path_documents(source, stats)
    return _capped(documents, source, max_bytes, stats)
