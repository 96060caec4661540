"""Eval loss of certified versions for the dashboard, off the runtime loop.

Cheap by construction: only for models up to ``max_params`` parameters, a few batches, on a
separate copy of the model in a worker thread, at most one evaluation at a time (a version that
lands while one runs is skipped). Never blocks training or the network.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.train.data import PackedCorpus, eval_batches
from p2pdiloco.train.inner import evaluate
from p2pdiloco.train.models import build_for_loading, param_state


class Evaluator:
    def __init__(
        self,
        manifest: RunManifest,
        corpus: PackedCorpus | None,
        max_params: int,
        on_loss: Callable[[float], None],
    ) -> None:
        self.manifest = manifest
        self.corpus = corpus
        self.max_params = max_params
        self.on_loss = on_loss
        self._model: torch.nn.Module | None = None
        self._rows: list[torch.Tensor] = []
        self._busy = False

    def spawn(self, state: CertifiedState, loop: asyncio.AbstractEventLoop) -> None:
        """Evaluate ``state`` in a worker thread unless busy, too big, or without a corpus."""
        if self.corpus is None or self._busy:
            return
        if sum(t.numel() for t in state.params.values()) > self.max_params:
            return
        self._busy = True
        loop.run_in_executor(None, self._run, state).add_done_callback(self._done)

    def _run(self, state: CertifiedState) -> float | None:
        if self._model is None:
            self._model = build_for_loading(self.manifest.model)
            assert self.corpus is not None
            self._rows = eval_batches(
                self.corpus, batch_size=self.manifest.inner.batch_size, max_batches=2
            )
        if not self._rows:
            return None
        with torch.no_grad():
            for n, p in param_state(self._model).items():
                p.copy_(state.params[n])
        return evaluate(self._model, self._rows)

    def _done(self, fut: asyncio.Future[float | None]) -> None:
        self._busy = False
        if not fut.cancelled() and fut.exception() is None:
            loss = fut.result()
            if loss is not None:
                self.on_loss(float(loss))
