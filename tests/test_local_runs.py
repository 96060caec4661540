"""Runs kept on disk (``net.local_runs``) and who stores a run's records again (``net.republish``).

The real-process story (a bootstrap restarted empty, volunteers resuming from disk) is
tests/test_run_outlives.py; these are the decisions it rests on, without a network.
"""

from __future__ import annotations

import json
from pathlib import Path

from p2pdiloco.net.local_runs import (
    MANIFEST_FILE,
    local_run_by_id,
    manifest_paths,
    newest_local_run,
    read_local_runs,
    runs_root,
)
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.net.republish import REPUBLISHERS_PER_INTERVAL, interval_index, republishes
from p2pdiloco.protocol.identity import Identity

CREATOR = Identity.generate()


def keep(directory: Path, model: str = "gemma-tiny", seed: int = 0, created: float = 1e9) -> str:
    """A signed manifest saved as a node saves it; its run id."""
    run_id, _, raw = create_manifest(
        CREATOR,
        name="r",
        model=model,
        data="embedded",
        seed=seed,
        inner_steps=8,
        committee_size=1,
        quorum=1,
        created_at=created,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST_FILE).write_bytes(raw)
    return run_id


def test_kept_manifests_are_found_in_the_state_dir_and_the_default_directories(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data" / "p2pdiloco"
    a = keep(runs_root(data) / "aaaa", seed=1)
    b = keep(tmp_path / "elsewhere", seed=2)
    paths = manifest_paths(tmp_path / "elsewhere", data)
    assert paths[0] == (tmp_path / "elsewhere" / MANIFEST_FILE).resolve()  # the given one first
    assert {r.info.run_id for r in read_local_runs(paths)} == {a, b}
    assert manifest_paths(None, tmp_path / "nothing here") == []
    assert manifest_paths(tmp_path / "no state yet", tmp_path / "nothing here") == []


def test_a_kept_run_is_chosen_by_id_prefix_or_as_the_newest_of_its_model(tmp_path: Path) -> None:
    old = keep(tmp_path / "old", seed=1, created=1e9 + 60)
    new = keep(tmp_path / "new", seed=2, created=1e9 + 120)  # the newest
    other = keep(tmp_path / "other", model="gemma-small", seed=3, created=1e9 + 180)
    runs = read_local_runs(tmp_path / d / MANIFEST_FILE for d in ("old", "new", "other"))
    assert local_run_by_id(runs, old[:8]) is not None
    assert local_run_by_id(runs, old[:8]).info.run_id == old  # type: ignore[union-attr]
    assert local_run_by_id(runs, "") is None  # several match: not a choice
    assert local_run_by_id(runs, "z") is None
    best, count = newest_local_run(runs, "gemma-tiny")
    assert best is not None and best.info.run_id == new and count == 2
    assert best.path == tmp_path / "new" / MANIFEST_FILE and best.info.raw
    assert newest_local_run(runs, "gemma-small")[0].info.run_id == other  # type: ignore[union-attr]
    assert newest_local_run(runs, "gemma-1b") == (None, 0)


def test_a_corrupt_or_forged_kept_manifest_is_skipped(tmp_path: Path) -> None:
    good = keep(tmp_path / "good")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / MANIFEST_FILE).write_bytes(b"\x00not json")
    forged = tmp_path / "forged"
    keep(forged, seed=5)
    doc = json.loads((forged / MANIFEST_FILE).read_bytes())
    doc["body"]["seed"] = 6  # the signature no longer covers the body
    (forged / MANIFEST_FILE).write_text(json.dumps(doc))
    paths = [tmp_path / d / MANIFEST_FILE for d in ("good", "junk", "forged")]
    assert [r.info.run_id for r in read_local_runs(paths)] == [good]


def test_a_few_live_members_store_the_records_again_each_interval() -> None:
    peers = [Identity.generate().peer_id for _ in range(40)]
    k = REPUBLISHERS_PER_INTERVAL
    chosen_ever: set[str] = set()
    for index in range(200):
        chosen = [p for p in peers if republishes(p, peers, index)]
        assert len(chosen) == k  # the same view: exactly k per interval, whatever the run's size
        chosen_ever |= set(chosen)
    assert chosen_ever == set(peers)  # drawn afresh: no member carries it alone
    # A small run: every member, every interval (each one counts itself in).
    small = peers[:k]
    assert all(republishes(p, small[:1], 7) for p in small)
    assert interval_index(10.9, 5.0) == 2 and interval_index(11.0, 5.0) == 2
