"""Runs whose signed manifest this machine kept: how a run outlives the DHT's memory of it.

Every training node saves the run's signed manifest as ``manifest.json`` in its state directory
(``runtime.launch``). When the DHT has forgotten a run (a bootstrap restarted empty while every
volunteer was offline), ``join --run ID`` and ``join --model NAME`` find it here, and the node
publishes it again (``node.Node``). A manifest is self-certifying: its run id is its hash and
its creator signed it, so a copy read from disk is as good as one read from the DHT; a file that
does not verify is skipped with a log line, never trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from p2pdiloco.errors import UserError
from p2pdiloco.net.discovery import RunInfo
from p2pdiloco.protocol.records import parse_manifest
from p2pdiloco.protocol.signing import InvalidRecord, open_envelope

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
# Larger than any manifest a run can sign; a bigger file here is not one.
MAX_MANIFEST_BYTES = 64 * 1024


@dataclass(frozen=True)
class LocalRun:
    info: RunInfo  # verified, with ``raw`` the signed bytes for re-publishing as they are
    path: Path  # the manifest file it was read from


def runs_root(data_dir: Path) -> Path:
    """Where the default state directories are: ``<data dir>/runs/<run id prefix>``."""
    return data_dir / "runs"


def manifest_paths(state_dir: Path | None, data_dir: Path) -> list[Path]:
    """Manifest files to look at: the given state directory's first, then every default state
    directory under ``data_dir`` (``runs/*/manifest.json``), each once."""
    paths = [state_dir / MANIFEST_FILE] if state_dir is not None else []
    root = runs_root(data_dir)
    if root.is_dir():
        paths += sorted(root.glob(f"*/{MANIFEST_FILE}"))
    return list(dict.fromkeys(p.resolve() for p in paths if p.is_file()))


def read_local_runs(paths: Iterable[Path]) -> list[LocalRun]:
    """The verified manifests among ``paths`` (compatible with this build), each run once."""
    found: dict[str, LocalRun] = {}
    for path in paths:
        try:
            raw = path.read_bytes()
            run_id, manifest = parse_manifest(
                open_envelope(raw, kind="manifest", max_bytes=MAX_MANIFEST_BYTES)
            )
        except (OSError, InvalidRecord, UserError) as e:
            log.info("not using the manifest in %s: %s", path, e)
            continue
        found.setdefault(run_id, LocalRun(RunInfo(run_id, manifest, raw=raw), path))
    return list(found.values())


def local_run_by_id(runs: list[LocalRun], prefix: str) -> LocalRun | None:
    """The local run whose id starts with ``prefix``; None if none or several do."""
    match = [r for r in runs if r.info.run_id.startswith(prefix)]
    return match[0] if len(match) == 1 else None


def newest_local_run(runs: list[LocalRun], model: str) -> tuple[LocalRun | None, int]:
    """The most recently created local run of ``model`` (ties: the larger run id), and how many
    local runs of ``model`` there are."""
    of_model = [r for r in runs if r.info.manifest.model == model]
    if not of_model:
        return None, 0
    best = max(of_model, key=lambda r: (r.info.manifest.created_at, r.info.run_id))
    return best, len(of_model)
