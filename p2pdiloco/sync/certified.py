"""The certified global state a node holds: version, certificate, parameters, outer momentum.

Version 0 (genesis) needs no certificate: every node builds it from the manifest (model and
seed; momentum zero) and gets the same state hash. Every later version is applied only with a
certificate whose ``state_hash`` equals the hash of exactly these tensors (``sync.state``),
either downloaded whole or made from the version before by its certified update
(``apply_update``, ADR 0029).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from p2pdiloco.protocol.certificates import Certificate
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest, SyncRules
from p2pdiloco.sync.aggregator import MergeInput, MergeResult, merge_round
from p2pdiloco.sync.fragments import round_names, round_shapes
from p2pdiloco.sync.scoring import WorkCheck
from p2pdiloco.sync.state import StateBlob, encode_state
from p2pdiloco.sync.update import (
    UpdateError,
    decode_update,
    hash_update,
    pack_update,
    update_codec,
)
from p2pdiloco.train.models import build_model, param_state
from p2pdiloco.train.outer import MOMENTUM_PREFIX, OuterConfig, outer_update_


@dataclass
class CertifiedState:
    version: int
    cert: Certificate | None  # None only at genesis
    params: dict[str, torch.Tensor]  # fp32, CPU
    momentum: dict[str, torch.Tensor]  # outer Nesterov buffers by parameter name
    # The packed update that made this version from the one before (sync.update), served to
    # peers holding that one; None at genesis, after a full download or a restart.
    update: bytes | bytearray | None = field(default=None, repr=False)
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

    @property
    def update_hash(self) -> str | None:
        return hash_update(self.update) if self.update is not None else None

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


def _shapes(state: CertifiedState) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in state.params.items()}


def genesis_state(manifest: RunManifest) -> CertifiedState:
    """Version 0: the seeded initialisation every node computes identically."""
    model = build_model(manifest.model, seed=manifest.seed, device=torch.device("cpu"))
    params = {n: t.detach().float().clone() for n, t in param_state(model).items()}
    momentum = {n: torch.zeros_like(t) for n, t in params.items()}
    return CertifiedState(0, None, params, momentum)


def next_state(
    base: CertifiedState,
    inputs: list[MergeInput],
    rules: SyncRules,
    outer: OuterConfig,
    work: WorkCheck | None = None,
) -> tuple[MergeResult, CertifiedState]:
    """The state a syncer signs after merging ``inputs`` on ``base`` (its hash computed), with
    the update that made it (``rules.update_codec``): the one tensor path of the network syncer
    (``sync.service``) and the simulator's tensor mode. Only the round's fragment
    (``sync.fragments``: all tensors when ``outer.fragments`` is 1) is merged and stepped; the
    new state shares the base's other tensors. ``work``: the run's work check (ADR 0062), None when it scores no work.
    Raises what ``merge_round`` raises."""
    codec = update_codec(rules.update_codec)
    names = round_names(_shapes(base), outer.fragments, base.version)
    result = merge_round(
        {n: base.params[n] for n in names},
        {n: base.momentum[n] for n in names},
        inputs,
        rules=rules,
        outer=outer,
        update_codec=codec,
        work=work,
    )
    raw = pack_update(result.update)  # empties result.update: the pack holds it now
    params = {n: result.params.get(n, t) for n, t in base.params.items()}
    momentum = {n: result.momentum.get(n, t) for n, t in base.momentum.items()}
    state = CertifiedState(base.version + 1, None, params, momentum, update=raw)
    state.blob()
    return result, state


def apply_update(
    base: CertifiedState,
    cert: Certificate,
    raw: bytes | bytearray,
    rules: SyncRules,
    outer: OuterConfig,
) -> CertifiedState:
    """The state ``cert`` certifies, made from ``base`` (the version before) and the update
    ``raw``: the hash checked against ``cert.body.update_hash``, decoded, the outer step applied
    as the committee did (element-wise fp32, so bit for bit), the state hash checked.

    Raises UpdateError: NOT_FOUND (no update certified, or ``base`` is not the version before),
    DIGEST_MISMATCH (``raw`` is not the certified update: blame whoever served it), MALFORMED
    (certified bytes that do not decode), STATE_MISMATCH (the step does not give the certified
    state: the certificate's two hashes disagree). Never installs anything itself.
    """
    body = cert.body
    if body.update_hash is None or body.version != base.version + 1:
        raise UpdateError(Reason.NOT_FOUND, f"no update from version {base.version} certified")
    if hash_update(raw) != body.update_hash:
        raise UpdateError(Reason.DIGEST_MISMATCH, "update does not match the certified hash")
    shapes = round_shapes(_shapes(base), outer.fragments, base.version)
    g_hat = decode_update(raw, rules.update_codec, shapes)
    params, momentum = dict(base.params), dict(base.momentum)  # other fragments: shared
    for n in sorted(shapes):
        params[n] = base.params[n].detach().float().clone()
        momentum[n] = base.momentum[n].detach().float().clone()
        outer_update_(params[n].view(-1), momentum[n].view(-1), g_hat[n].reshape(-1), outer)
    state = CertifiedState(body.version, cert, params, momentum, update=raw)
    if state.state_hash != body.state_hash:
        raise UpdateError(
            Reason.STATE_MISMATCH,
            f"the certified update of version {body.version} gives state "
            f"{state.state_hash[:12]}, not the certified {body.state_hash[:12]}",
        )
    return state
