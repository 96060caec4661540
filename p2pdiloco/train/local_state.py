"""A learner's uncertified progress, saved on a graceful stop and picked up by the next ``join``.

The certified state is saved after every version (``CheckpointStore``); what a stop would
otherwise lose is the work since: the local parameters, the inner AdamW moments, the
error-feedback residuals and the data position. They are written atomically next to the
certified checkpoints with the version they are based on; on resume they are rebased onto
whatever version the network has reached (``Learner.rebase``), so no step is lost or counted
twice. A file that is unreadable, from another run or for another model is ignored with a
warning: the certified state alone is always a valid place to resume from.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.train.checkpoint import atomic_write
from p2pdiloco.train.learner import Learner

log = logging.getLogger(__name__)

LOCAL_FILE = "local.pt"
FORMAT = 1


def save_local(state_dir: Path, learner: Learner, run_id: str, base_version: int) -> Path:
    """Write the learner's local state (atomic); returns the path."""
    path = state_dir / LOCAL_FILE
    blob = {
        "format": FORMAT,
        "run_id": run_id,
        "base_version": base_version,
        "rounds_done": learner.rounds_done,
        "steps_since_send": learner.steps_since_send,
        "params": {n: t.detach().cpu() for n, t in learner.params().items()},
        "optimizer": learner.optimizer_state(),  # None: an island's (sharded) moments
        "feedback": learner.feedback.state_tensors(),
    }
    atomic_write(path, lambda tmp: torch.save(blob, tmp))
    return path


def load_local(state_dir: Path, run_id: str) -> dict[str, Any] | None:
    """The saved local state of ``run_id``, or None (absent, unreadable or another run)."""
    path = state_dir / LOCAL_FILE
    if not path.exists():
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a torn or foreign file must never stop a node from starting
        log.warning("ignoring saved local progress %s: %s", path, e)
        return None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT or blob.get("run_id") != run_id:
        log.warning("ignoring saved local progress %s: another run or format", path)
        return None
    return blob


def restore_local(learner: Learner, blob: dict[str, Any]) -> bool:
    """Load a saved local state into ``learner``; False (and a warning) if it does not fit."""
    params = learner.params()
    saved = blob.get("params", {})
    if set(saved) != set(params) or any(saved[n].shape != p.shape for n, p in params.items()):
        log.warning("ignoring saved local progress: it is for another model shape")
        return False
    learner.load(saved)
    try:
        if blob.get("optimizer") is None or learner.optimizer_state() is None:
            raise ValueError("the saved moments are sharded over an island's ranks, or none")
        learner.optimizer.load_state_dict(blob["optimizer"])
        learner.feedback.load_state_tensors(blob.get("feedback", {}))
    except (KeyError, ValueError, RuntimeError) as e:
        log.warning("saved optimizer state not restored (%s); continuing with fresh moments", e)
    learner.rounds_done = int(blob.get("rounds_done", learner.rounds_done))
    learner.steps_since_send = int(blob.get("steps_since_send", 0))
    return True
