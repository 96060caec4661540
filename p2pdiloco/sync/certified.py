"""The certified global state a node holds: version, certificate, parameters, outer momentum.

Version 0 (genesis) needs no certificate: every node builds it from the manifest (model and
seed; momentum zero) and gets the same state hash. Every later version is applied only with a
certificate whose ``state_hash`` equals the hash of exactly these tensors (``sync.state``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from p2pdiloco.protocol.certificates import Certificate
from p2pdiloco.protocol.records import RunManifest, SyncRules
from p2pdiloco.sync.aggregator import MergeInput, MergeResult, merge_round
from p2pdiloco.sync.state import StateBlob, encode_state
from p2pdiloco.train.models import build_model, param_state
from p2pdiloco.train.outer import MOMENTUM_PREFIX, OuterConfig


@dataclass
class CertifiedState:
    version: int
    cert: Certificate | None  # None only at genesis
    params: dict[str, torch.Tensor]  # fp32, CPU
    momentum: dict[str, torch.Tensor]  # outer Nesterov buffers by parameter name
    _blob: StateBlob | None = field(default=None, repr=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.params, **{MOMENTUM_PREFIX + n: m for n, m in self.momentum.items()}}

    def blob(self) -> StateBlob:
        """The chunked, hashed form peers download (computed once)."""
        if self._blob is None:
            self._blob = encode_state(self.tensors(), self.version)
        return self._blob

    @property
    def state_hash(self) -> str:
        return self.blob().state_hash

    @classmethod
    def from_tensors(
        cls, version: int, cert: Certificate | None, tensors: dict[str, torch.Tensor]
    ) -> CertifiedState:
        params = {n: t for n, t in tensors.items() if not n.startswith(MOMENTUM_PREFIX)}
        momentum = {
            n[len(MOMENTUM_PREFIX) :]: t
            for n, t in tensors.items()
            if n.startswith(MOMENTUM_PREFIX)
        }
        if set(momentum) != set(params):
            raise ValueError("state must hold one momentum buffer per parameter")
        return cls(version, cert, params, momentum)


def genesis_state(manifest: RunManifest) -> CertifiedState:
    """Version 0: the seeded initialisation every node computes identically."""
    model = build_model(manifest.model, seed=manifest.seed, device=torch.device("cpu"))
    params = {n: t.detach().float().clone() for n, t in param_state(model).items()}
    momentum = {n: torch.zeros_like(t) for n, t in params.items()}
    return CertifiedState(0, None, params, momentum)


def next_state(
    base: CertifiedState, inputs: list[MergeInput], rules: SyncRules, outer: OuterConfig
) -> tuple[MergeResult, CertifiedState]:
    """The state a syncer signs after merging ``inputs`` on ``base`` (its hash computed): the
    one tensor path of the network syncer (``sync.service``) and the simulator's tensor mode.
    Raises what ``merge_round`` raises."""
    result = merge_round(base.params, base.momentum, inputs, rules=rules, outer=outer)
    state = CertifiedState(base.version + 1, None, result.params, result.momentum)
    state.blob()
    return result, state
