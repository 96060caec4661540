"""The certified global state a node holds: version, certificate, parameters, committee state.

The committee state is what a syncer needs beyond the parameters to make the next version: the
outer momentum, and in runs whose update is the parameters' change (``rules.update_form``
"params", ADR 0064) the error-feedback residual of that update. Version 0 (genesis) needs no
certificate: every node builds it from the manifest (model and seed; momentum and residual
zero) and gets the same state hash. Every later version is applied only with a certificate
whose ``state_hash`` equals the hash of exactly these tensors (``sync.state``), either
downloaded whole or made from the version before by its certified update (``apply_update``,
ADR 0029). A node that follows "params" updates holds the parameters alone (``momentum`` None),
checked against the certificate's ``params_hash``; it downloads the committee state when it
sits on a committee (``runtime.obtain.committee_state``).
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
from p2pdiloco.sync.state import StateBlob, StateError, encode_state
from p2pdiloco.sync.update import (
    UpdateError,
    decode_update,
    hash_update,
    pack_update,
    rules_codec,
)
from p2pdiloco.train.models import build_model, param_state
from p2pdiloco.train.outer import (
    MOMENTUM_PREFIX,
    RESIDUAL_PREFIX,
    OuterConfig,
    apply_params_step,
    outer_update_,
)


@dataclass
class CertifiedState:
    version: int
    cert: Certificate | None  # None only at genesis
    params: dict[str, torch.Tensor]  # fp32, CPU
    # Outer Nesterov buffers by parameter name; None: the parameters alone are held (a
    # follower of "params" updates, ADR 0064), whose committee state only a download gives.
    momentum: dict[str, torch.Tensor] | None
    # The packed update that made this version from the one before (sync.update), served to
    # peers holding that one; None at genesis, after a full download or a restart.
    update: bytes | bytearray | None = field(default=None, repr=False)
    # The update's error-feedback residual by parameter name ("params" updates, held with the
    # momentum); empty for "gradient" updates, whose state is parameters and momentum.
    residual: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _blob: StateBlob | None = field(default=None, repr=False)
    _params_blob: StateBlob | None = field(default=None, repr=False)

    @property
    def committee_state(self) -> bool:
        """True when the state holds what a syncer merges on (momentum, and any residual)."""
        return self.momentum is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything held, as ``state_hash`` covers it (the parameters alone when
        ``committee_state`` is False)."""
        momentum = self.momentum or {}
        return {
            **self.params,
            **{MOMENTUM_PREFIX + n: m for n, m in momentum.items()},
            **{RESIDUAL_PREFIX + n: r for n, r in self.residual.items()},
        }

    def blob(self) -> StateBlob:
        """The chunked, hashed form peers download (computed once); StateError without the
        committee state, which a certificate's ``state_hash`` covers."""
        if not self.committee_state:
            raise StateError(f"version {self.version}: only the parameters are held here")
        if self._blob is None:
            self._blob = encode_state(self.tensors(), self.version)
        return self._blob

    def params_blob(self) -> StateBlob:
        """The parameters alone, chunked and hashed as peers download them: its hash is a
        certificate's ``params_hash`` (ADR 0064). Computed once."""
        if self._params_blob is None:
            self._params_blob = encode_state(self.params, self.version)
        return self._params_blob

    @property
    def state_hash(self) -> str:
        return self.blob().state_hash

    @property
    def params_hash(self) -> str:
        return self.params_blob().state_hash

    def matches(self, cert: Certificate) -> bool:
        """Whether this is what ``cert`` certifies: the whole state against ``state_hash``, or
        the parameters alone (``committee_state`` False) against ``params_hash``."""
        if self.version != cert.body.version:
            return False
        if self.committee_state:
            return self.state_hash == cert.body.state_hash
        return cert.body.params_hash is not None and self.params_hash == cert.body.params_hash

    @property
    def update_hash(self) -> str | None:
        return hash_update(self.update) if self.update is not None else None

    @classmethod
    def from_tensors(
        cls, version: int, cert: Certificate | None, tensors: dict[str, torch.Tensor]
    ) -> CertifiedState:
        """The state of ``tensors`` as ``tensors()`` lays it out: parameters, then momentum
        and residual buffers by prefix. ValueError unless every parameter has a momentum buffer
        (or none has: the parameters alone) and the residual is none or one per parameter."""
        prefixes = (MOMENTUM_PREFIX, RESIDUAL_PREFIX)
        params = {n: t for n, t in tensors.items() if not n.startswith(prefixes)}
        momentum = _strip(tensors, MOMENTUM_PREFIX)
        residual = _strip(tensors, RESIDUAL_PREFIX)
        if momentum and set(momentum) != set(params):
            raise ValueError("state must hold one momentum buffer per parameter")
        if residual and (set(residual) != set(params) or not momentum):
            raise ValueError("state must hold one residual per parameter, beside the momentum")
        return cls(version, cert, params, momentum or None, residual=residual)


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}


def _shapes(state: CertifiedState) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in state.params.items()}


def genesis_state(manifest: RunManifest) -> CertifiedState:
    """Version 0: the seeded initialisation every node computes identically."""
    model = build_model(manifest.model, seed=manifest.seed, device=torch.device("cpu"))
    params = {n: t.detach().float().clone() for n, t in param_state(model).items()}
    momentum = {n: torch.zeros_like(t) for n, t in params.items()}
    residual = (
        {n: torch.zeros_like(t) for n, t in params.items()}
        if manifest.rules.update_form == "params"
        else {}
    )
    return CertifiedState(0, None, params, momentum, residual=residual)


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
    new state shares the base's other tensors. With "params" updates (ADR 0064) the merge keeps
    the residual beside the momentum and the state's ``params_hash`` is computed too. Raises
    what ``merge_round`` raises, and ValueError for a base without the committee state.
    ``work``: the run's work check (ADR 0062), None when it scores no work."""
    if base.momentum is None:
        raise ValueError(f"version {base.version}: no committee state here to merge on")
    names = round_names(_shapes(base), outer.fragments, base.version)
    feedback = rules.update_form == "params"
    result = merge_round(
        {n: base.params[n] for n in names},
        {n: base.momentum[n] for n in names},
        inputs,
        rules=rules,
        outer=outer,
        update_codec=rules_codec(rules),
        residual={n: base.residual[n] for n in names if n in base.residual} if feedback else None,
        work=work,
    )
    raw = pack_update(result.update)  # empties result.update: the pack holds it now
    params = {n: result.params.get(n, t) for n, t in base.params.items()}
    momentum = {n: result.momentum.get(n, t) for n, t in base.momentum.items()}
    residual = {**base.residual, **result.residual} if feedback else {}
    state = CertifiedState(base.version + 1, None, params, momentum, update=raw, residual=residual)
    state.blob()
    if feedback:
        state.params_blob()
    return result, state


def certified_params_hash(state: CertifiedState, rules: SyncRules) -> str | None:
    """What a certificate of ``state`` carries as ``params_hash``: the parameters' hash with
    "params" updates (ADR 0064), None (absent) otherwise."""
    return state.params_hash if rules.update_form == "params" else None


def apply_update(
    base: CertifiedState,
    cert: Certificate,
    raw: bytes | bytearray,
    rules: SyncRules,
    outer: OuterConfig,
) -> CertifiedState:
    """The state ``cert`` certifies, made from ``base`` (the version before) and the update
    ``raw``: the hash checked against ``cert.body.update_hash``, decoded, the outer step applied
    as the committee did (element-wise fp32, so bit for bit), the state hash checked. With
    "params" updates (ADR 0064) the decoded update is added to the parameters alone and the
    result is checked against ``cert.body.params_hash``: ``base`` needs no committee state.

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
    if rules.update_form == "params":
        return _add_update(base, cert, decode_update(raw, rules_codec(rules), shapes), raw)
    if base.momentum is None:
        raise UpdateError(Reason.NOT_FOUND, f"version {base.version}: no momentum held here")
    g_hat = decode_update(raw, rules_codec(rules), shapes)
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


def _add_update(
    base: CertifiedState,
    cert: Certificate,
    sent: dict[str, torch.Tensor],
    raw: bytes | bytearray,
) -> CertifiedState:
    """A "params" update (ADR 0064) applied: θ + decode(u) per tensor of the round's fragment,
    the parameters alone held, checked against the certificate's ``params_hash``."""
    body = cert.body
    if body.params_hash is None:
        raise UpdateError(Reason.NOT_FOUND, f"version {body.version} certifies no params hash")
    params = dict(base.params)  # other fragments: shared
    for n in sorted(sent):
        params[n] = apply_params_step(base.params[n].detach(), sent[n].reshape(params[n].shape))
    state = CertifiedState(body.version, cert, params, None, update=raw)
    if state.params_hash != body.params_hash:
        raise UpdateError(
            Reason.STATE_MISMATCH,
            f"the certified update of version {body.version} gives parameters "
            f"{state.params_hash[:12]}, not the certified {body.params_hash[:12]}",
        )
    return state
