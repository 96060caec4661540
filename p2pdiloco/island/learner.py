"""The learner of an island: rank 0's ``Learner``, whose model lives sharded over the island.

Everything the trainer thread does to its learner works unchanged: ``train`` posts the step
batches (the run's batch, split over the ranks, so the island's delta is the one a single
process would make on those rows and its token count is all the ranks' rows), ``params``
gathers the full parameters onto rank 0 (the delta, rebases, saving progress), ``load`` and
``rebase`` scatter a state from rank 0. When a member stops, the command raises
``IslandBroken``; the trainer then calls ``reform`` with the state to go on from.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.island.leader import Island
from p2pdiloco.island.spec import IslandSpec
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.train.data import PackedCorpus
from p2pdiloco.train.inner import InnerStats
from p2pdiloco.train.learner import Learner, Outgoing, rebased


class IslandLearner(Learner):
    def __init__(
        self,
        manifest: RunManifest,
        corpus: PackedCorpus,
        peer_id: str,
        base_params: Mapping[str, torch.Tensor],
        *,
        spec: IslandSpec,
        log_dir: Path,
        **kw: Any,
    ) -> None:
        self.spec, self.log_dir = spec, log_dir
        super().__init__(
            manifest, corpus, peer_id, base_params, device=torch.device(spec.devices[0]), **kw
        )

    def _setup(self, base_params: Mapping[str, torch.Tensor], global_step: int) -> None:
        accum = self.cfg.grad_accum
        micro = self.cfg.batch_size // accum if accum > 1 else None
        self.island = Island(
            self.spec,
            self.manifest.model,
            self.manifest.seed,
            self.cfg,
            log_dir=self.log_dir,
            micro_batch=micro,
        )
        try:
            self._adopt(self.island.form(global_step))
            self.load(base_params)
        except BaseException:
            self.island.close(timeout=2.0)
            raise

    def _adopt(self, shards: Any) -> None:
        self.model, self.optimizer, self.scheduler = (
            shards.model,
            shards.optimizer,
            shards.scheduler,
        )

    @property
    def world(self) -> int:
        return self.island.world

    def seek(self, global_step: int) -> None:
        self.island.call("seek", step=global_step)

    def params(self) -> dict[str, torch.Tensor]:
        full = self.island.call("gather")
        assert full is not None
        return full

    @torch.no_grad()
    def load(self, params: Mapping[str, torch.Tensor]) -> None:
        self.island.call("scatter", full=params)

    def optimizer_state(self) -> dict | None:
        return None

    def _train_batches(self, batches: torch.Tensor) -> InnerStats:
        stats: InnerStats = self.island.call("train", batches=batches)
        return stats

    @torch.no_grad()
    def rebase(
        self,
        new_base: Mapping[str, torch.Tensor],
        old_base: Mapping[str, torch.Tensor],
        sent: Outgoing | None,
    ) -> None:
        self.load(dict(rebased(self.params(), new_base, old_base, sent)))

    def reform(self, state: Mapping[str, torch.Tensor]) -> int:
        """After ``IslandBroken``: form the next generation from the members still running
        and go on from ``state`` (the last certified version, or the parameters a delta in
        flight was taken from); the broken stretch's steps are gone. Returns the new size."""
        step = int(self.scheduler.last_epoch)
        self._adopt(self.island.reform(step))
        self.load(state)
        self.steps_since_send, self.stretch_norm = 0, None
        return self.island.world

    def after_send(self, sent: Outgoing) -> int | None:
        """Right after a send, θ_local is θ_sent on the sent fragment: the moment members that
        registered since the island formed (other hosts of a LAN island) are taken in, by
        forming the next generation and loading the parameters as they are, so no step is lost
        (the inner optimizer's moments start afresh). Returns the new size, or None."""
        if not self.island.newcomers():
            return None
        before = self.island.world
        local = self.params()  # θ_sent on the sent fragment, every other tensor as trained
        self._adopt(self.island.reform(int(self.scheduler.last_epoch)))
        self.load(local)
        return self.island.world if self.island.world != before else None

    def close(self) -> None:
        self.island.close()
