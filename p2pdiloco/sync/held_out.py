"""The eval step of the merge: a certified state's loss on the run's held-out batches (ADR 0059).

A committee member runs it in the merge's worker thread, on the state it just merged, before
it builds the certificate body: the view's leader puts its value in the body, the others check
it against theirs (``core.round``). Always float32 on the CPU, whatever the node trains on, so
that every member computes the same arithmetic: on one CPU the value is bit-exact across
runs and thread counts (measured, ADR 0059); across CPU models the tolerance covers the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.sync.stopping import StopFlag
from p2pdiloco.train.data import PackedCorpus, held_out_batches
from p2pdiloco.train.inner import evaluate
from p2pdiloco.train.models import build_for_loading, param_state


class HeldOutEval:
    """Loss of a state's parameters on the fixed, seeded held-out batches of ``manifest``."""

    def __init__(self, manifest: RunManifest, corpus: PackedCorpus) -> None:
        held = manifest.held_out
        if held is None:
            raise ValueError("the run names no held-out split")
        self.batches = held_out_batches(
            corpus, seed=held.seed, batches=held.batches, batch_size=manifest.inner.batch_size
        )
        if not self.batches:
            raise ValueError(f"{corpus.source!r} holds no eval rows to evaluate on")
        self.model_name = manifest.model
        self._model: torch.nn.Module | None = None  # built on first use, then reused
        self._lock = threading.Lock()  # two merges (attempts) may overlap in worker threads
        self._stopping = StopFlag()  # set by the node's stop: an eval under way ends at a batch

    def stop(self) -> None:
        """Abandon an eval under way at its next batch, and every later one (MergeStopped)."""
        self._stopping.stop()

    def loss(self, params: Mapping[str, torch.Tensor]) -> float:
        """Token-weighted mean loss of the model with ``params`` (every trainable tensor)."""
        with self._lock, torch.no_grad():
            if self._model is None:
                self._model = build_for_loading(self.model_name)
            for n, p in param_state(self._model).items():
                p.copy_(params[n])
            return evaluate(self._model, self.batches, self._stopping.check)
