"""Typed bodies of the signed records: heartbeats and run manifests.

Every model is strict, forbids extra fields and bounds every string, list and number, because
bodies come from untrusted peers (and end up in dashboards: no control characters either).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from p2pdiloco.errors import UserError
from p2pdiloco.protocol.signing import (
    PROTOCOL_VERSION,
    Envelope,
    InvalidRecord,
    PeerIdStr,
    canonical_json,
    typed_body,
)

HEARTBEAT_KIND = "heartbeat"
MANIFEST_KIND = "manifest"
ISLAND_KIND = "island"
ROLES = ("bootstrap", "learner", "syncer")
_RUN_ID_DOMAIN = b"p2pdiloco/run-id/v1\x00"
_MAX_INT = 2**63 - 1

# Printable text only: peer-supplied strings are shown in terminals and web dashboards.
_PRINTABLE = r"^[^\x00-\x1f\x7f-\x9f]*$"
Text = Annotated[str, Field(max_length=256, pattern=_PRINTABLE)]
ShortText = Annotated[str, Field(min_length=1, max_length=64, pattern=_PRINTABLE)]
Multiaddr = Annotated[str, Field(min_length=2, max_length=256, pattern=r"^/[\x21-\x7e]+$")]
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
RuleName = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_-]+$")]
NonNegFloat = Annotated[float, Field(ge=0)]
NonNegInt = Annotated[int, Field(ge=0, le=_MAX_INT)]
Role = Literal["bootstrap", "learner", "syncer"]


class IncompatibleProtocol(UserError):
    """A run made by a p2pdiloco that speaks another protocol version."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


# ---------------------------------------------------------------------------------------------
# heartbeat


class Hardware(_Strict):
    """What a node trains on."""

    device: ShortText  # "cuda", "cpu", "mps", ...
    name: Text
    memory_gb: NonNegFloat = Field(le=1e6)
    count: int = Field(ge=0, le=4096)


class Heartbeat(_Strict):
    """Body of a ``heartbeat`` record: a node's liveness, roles, capacity and addresses."""

    peer_id: PeerIdStr
    island: ShortText
    roles: list[Role] = Field(max_length=len(ROLES))
    hardware: Hardware
    throughput_tps: NonNegFloat
    version: NonNegInt  # latest certified global version the node holds
    addrs: list[Multiaddr] = Field(max_length=32)  # DHT / p2pd side
    gossip_addrs: list[Multiaddr] = Field(max_length=32)  # py-libp2p gossip host
    reachability: Literal["direct", "relayed", "unknown"]
    seq: NonNegInt
    # Seconds the node has waited for the certificate of version + 1 once past the run's stall
    # threshold (grace + agree_timeout after sending); 0 while rounds certify. `status` shows a
    # run whose live peers report it as stalled.
    stalled_s: NonNegFloat = 0.0

    @model_validator(mode="after")
    def _roles_unique(self) -> Self:
        if len(set(self.roles)) != len(self.roles):
            raise ValueError("roles must not repeat")
        return self


def parse_heartbeat(env: Envelope) -> Heartbeat:
    """The typed heartbeat of a verified envelope.

    Raises InvalidRecord if the envelope is not a heartbeat, the body fails the schema, or the
    body's ``peer_id`` is not the envelope's signer (a node may only speak for itself).
    """
    if env.kind != HEARTBEAT_KIND:
        raise InvalidRecord(f"expected a heartbeat, got {env.kind[:64]!r}", signer=env.signer)
    return typed_body(env, Heartbeat, "heartbeat", "peer_id")


# ---------------------------------------------------------------------------------------------
# island rendezvous

HostPort = Annotated[
    str, Field(min_length=3, max_length=128, pattern=r"^[A-Za-z0-9.\-]+:[0-9]{1,5}$")
]


class IslandRendezvous(_Strict):
    """Body of an ``island`` record: where the members of a LAN island find its rank 0."""

    peer_id: PeerIdStr  # rank 0: the node that speaks for the island
    island: ShortText  # the name every host of the island passes to ``join --island``
    store: HostPort  # rank 0's TCPStore (commands and torch.distributed rendezvous)
    backend: Literal["gloo", "nccl"]
    ranks: int = Field(ge=1, le=4096)  # ranks of the island now


def parse_island(env: Envelope) -> IslandRendezvous:
    """The typed rendezvous of a verified envelope; InvalidRecord as ``parse_heartbeat``."""
    if env.kind != ISLAND_KIND:
        raise InvalidRecord(f"expected an island record, got {env.kind[:64]!r}", signer=env.signer)
    return typed_body(env, IslandRendezvous, "island record", "peer_id")


# ---------------------------------------------------------------------------------------------
# run manifest


def default_quorum(committee_size: int) -> int:
    """Byzantine quorum ``floor(2k/3) + 1`` for a committee of ``k``; raises ValueError if k < 1."""
    if committee_size < 1:
        raise ValueError("committee size must be at least 1")
    return (2 * committee_size) // 3 + 1


class InnerParams(_Strict):
    """Inner AdamW hyperparameters; same names and defaults as ``train.inner.InnerConfig``."""

    lr: float = Field(default=4e-4, gt=0, le=10)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    warmup_steps: int = Field(default=100, ge=0, le=10**9)
    total_steps: int = Field(default=10_000, ge=1, le=10**9)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    grad_clip: float = Field(default=1.0, ge=0, le=1e6)  # 0 disables
    grad_accum: int = Field(default=1, ge=1, le=4096)
    batch_size: int = Field(default=8, ge=1, le=2**20)
    seq_len: int = Field(default=128, ge=1, le=2**22)


class OuterParams(_Strict):
    """Outer Nesterov-SGD hyperparameters; same names and defaults as ``train.outer.OuterConfig``."""

    lr: float = Field(default=0.7, gt=0, le=10)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    nesterov: bool = True
    fragments: int = Field(default=1, ge=1, le=1024)


class WorkScoring(_Strict):
    """Work scoring (``sync.scoring``, ADR 0062): a learner training from certified version v
    reads rows assigned to it for v, a pure function of the run seed, its identity and v
    (``train.data.assigned_rows``), and the committee counts its delta only if it lowers the
    loss on a few seeded batches of those rows by more than two other trusted deltas of the
    round do on the same rows (ADR 0065; as many other rows when it has none). A trusted delta
    that does not is merged without credit, a probationary one refused."""

    # Seeded batches scored on each side (rows assigned, rows not assigned), and rows per batch.
    batches: int = Field(default=8, ge=1, le=64)
    rows: int = Field(default=8, ge=1, le=4096)
    # Least advantage a delta must show, in nats: the loss drop on its own rows, less that on
    # the other rows, and at most the own rows' drop (``sync.scoring``).
    margin: float = Field(default=0.0, ge=-1e3, le=1e3)
    # Screening before scoring: a delta whose cosine similarity to the last certified update or
    # to an earlier input of the round is at least this is a copy (replayed or cloned).
    max_cosine: float = Field(default=0.95, gt=0, le=1)
    # Deltas scored per round at most: probationary ones first, then trusted ones in a seeded
    # order; a probationary delta left unscored is refused, a trusted one merged as before.
    max_scored: int = Field(default=16, ge=1, le=4096)
    # The test a delta's work passes (ADR 0070). None: the paired score of ADR 0065 (its loss
    # drop on its own rows, less two peers' deltas' on the same rows, exceeds ``margin``). A
    # number: Welch's z of its per-row loss drops on its own rows against as many rows not
    # assigned exceeds it (``margin`` unused): zero in expectation for a delta that did not
    # train on those rows, whatever its size or age, so a stale honest delta passes too.
    z_min: float | None = Field(default=None, ge=0, le=100)

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Rules made before ADR 0070 serialise, hash and sign as they did: same run id.
        data: dict[str, Any] = handler(self)
        if self.z_min is None:
            data.pop("z_min", None)
        return data

    @classmethod
    def z_test(cls) -> WorkScoring:
        """What ``run create --score-work`` signs (ADR 0070): the z test at 3 standard errors
        (a delta without work on its rows passes 0.13 % of the time) on 8 batches of 16 rows a
        side: 128 of the stretch's own rows against 128 not assigned."""
        return cls(z_min=3.0, batches=8, rows=16)

    @property
    def pass_mark(self) -> float:
        """What a score must exceed to show work: ``z_min`` for the z test, else ``margin``."""
        return self.margin if self.z_min is None else self.z_min


class SyncRules(_Strict):
    """How a round turns submissions into the next certified state: every rule here changes the
    certified bytes (or which submissions make them), so every syncer must apply the same."""

    # Robust merge rule, one of ``p2pdiloco.aggregate.RULES`` (``sync.rules.check_supported``).
    aggregation: RuleName = "mean"
    # The rule's hyperparameters, e.g. {"f": 1} for trimmed_mean; get_rule validates them.
    aggregation_params: dict[RuleName, Annotated[float, Field(ge=-1e9, le=1e9)]] = Field(
        default_factory=dict, max_length=8
    )
    # Screening drops a delta whose L2 norm exceeds this × the median norm; None disables it.
    screen_norm_factor: float | None = Field(default=3.0, ge=1, le=1e6)
    # Clone folding (sync.clones, ADR 0036): screened deltas closer to one another than this ×
    # the median distance between trusted deltas are merged as one row. None: no folding.
    clone_factor: float | None = Field(default=None, ge=0, le=1)
    # Largest share of the total merge weight one submission may hold (water-filling cap).
    weight_cap: float = Field(default=0.25, gt=0, le=1)
    # Oldest base version a round accepts: certified version − staleness.
    # 0: a late delta is refused and its learner carries it into its next one (ADR 0026).
    staleness: int = Field(default=0, ge=0, le=10_000)
    # A round closes once this fraction of the active learners has submitted (then lingers).
    min_quorum_fraction: float = Field(default=0.6, gt=0, le=1)
    # Seconds a round collects before closing with what it has (at least one submission).
    grace: float = Field(default=60.0, gt=0, le=86_400)
    # Adaptive grace: with a lower bound set, a round closes with what it has after twice the
    # 90th percentile of the last rounds' arrival delays, kept within [grace_min, grace]
    # (core.arrivals). None: always after ``grace``. Timeouts still count the full ``grace``.
    grace_min: float | None = Field(default=None, gt=0, le=86_400)
    # Seconds a round keeps collecting after reaching min_quorum_fraction.
    linger: float = Field(default=3.0, ge=0, le=3_600)
    # Seconds without a proposal before the next committee member takes the lead.
    agree_timeout: float = Field(default=20.0, gt=0, le=3_600)
    # Seconds a committee member waits for a certificate after opening a view of a round before
    # it votes to hand the version to the next view's committee (protocol.view_change); None:
    # 3 × (grace + agree_timeout). Must exceed grace + agree_timeout.
    view_timeout: float | None = Field(default=None, gt=0, le=86_400)
    # Pacemaker (core.views, ADR 0055): each view that fails doubles the next one's timeout (and
    # the leader's agree_timeout), up to this many seconds; a certificate starts the next
    # version at ``view_timeout`` again. None: 8 × the view timeout. Omitted from the signed
    # manifest when None, so a manifest made before it keeps its bytes and run id.
    view_timeout_max: float | None = Field(default=None, gt=0, le=7 * 86_400)
    # Trust (core.trust, ADR 0016): an identity counts fully, closes rounds and may be elected
    # once the certified roster credits it with this many accepted deltas and it joined this
    # many versions earlier (or it is on the genesis committee); until then its submissions
    # hold at most ``probation_share`` of a round's inputs and of its merge weight.
    trust_min_accepted: int = Field(default=3, ge=0, le=1_000_000)
    trust_min_age: int = Field(default=3, ge=0, le=1_000_000)
    probation_share: float = Field(default=0.25, gt=0, le=1)
    # An identity may be elected to a committee only if a delta of it was merged in one of the
    # last ``committee_recency`` versions (roster ``last_version``): a volunteer who left stops
    # being drawn at once, instead of for the roster's window, and a committee that seats more
    # departed members than it can lose (k − q) never certifies (the simulator found this
    # stalling runs under churn: docs/adr/0021-network-simulator.md). None: no such condition.
    committee_recency: int | None = Field(default=2, ge=1, le=10_000)
    # Versions an identity stays on the certified roster, with its counters, after its last
    # merged delta (core.roster.next_roster; ADR 0045). A probationary learner waiting for room
    # in a crowded round keeps its progress towards trust that long. Rounds still wait only for
    # learners active in the last 3 versions (core.trust.learners_awaited).
    roster_window: int = Field(default=10, ge=0, le=10_000)
    # Codec of the certified update, the round's merged pseudo-gradient (ADR 0029): the committee
    # steps with its decoded value and learners download it instead of the state. One of
    # ``p2pdiloco.choices.UPDATE_CODECS`` (dense; ``sync.rules.check_supported``), or any codec
    # with ``update_form`` "params" (ADR 0064). "none": fp32.
    update_codec: RuleName = "none"
    # What the certified update is (ADR 0064). "gradient": the merged pseudo-gradient g, which a
    # follower steps with its own momentum (dense codecs only). "params": what the parameters
    # changed by, its unsent part kept as an error-feedback residual in the committee's state
    # beside the momentum; followers add it to their parameters and need neither (any codec,
    # sparse included).
    update_form: Literal["gradient", "params"] = "gradient"
    # Entries kept per chunk of 4096 by a topk2 update codec; None: the codec's 64 (1/64).
    update_k: int | None = Field(default=None, ge=1, le=4096)

    # Work scoring (ADR 0062): deltas earn a receipt, token credit and trust only if they show
    # work on the learner's own data. None: not scored (a run made before it; the bytes, run id
    # and signature of its manifest stay those of before).
    work: WorkScoring | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Rules from before ADRs 0055, 0062 and 0064 serialise, hash and sign as they did: same run id.
        data: dict[str, Any] = handler(self)
        if self.update_form == "gradient":
            data.pop("update_form", None)
        if self.update_k is None:
            data.pop("update_k", None)
        if self.work is None:
            data.pop("work", None)
        if self.view_timeout_max is None:
            data.pop("view_timeout_max", None)
        return data

    @model_validator(mode="after")
    def _grace_bounds(self) -> SyncRules:
        if self.grace_min is not None and self.grace_min > self.grace:
            raise ValueError("grace_min must not exceed grace")
        return self

    @model_validator(mode="after")
    def _view_after_round(self) -> SyncRules:
        if self.view_timeout is not None and self.view_timeout <= self.grace + self.agree_timeout:
            raise ValueError("view_timeout must exceed grace + agree_timeout")
        if self.view_timeout_max is not None and self.view_timeout_max < self.view_timeout_s:
            raise ValueError("view_timeout_max must not be below the view timeout")
        return self

    @property
    def view_timeout_s(self) -> float:
        """The view timeout in seconds, the default filled in."""
        if self.view_timeout is not None:
            return self.view_timeout
        return 3 * (self.grace + self.agree_timeout)

    @property
    def view_timeout_max_s(self) -> float:
        """The pacemaker's bound on one view's timeout, the default (8 × view timeout) filled
        in."""
        if self.view_timeout_max is not None:
            return self.view_timeout_max
        return 8 * self.view_timeout_s

    @property
    def give_up_after(self) -> float:
        """Seconds a learner waits on an undecided delta: long enough for two view changes."""
        return max(4 * (self.grace + self.agree_timeout), 3 * self.view_timeout_s)


class RunPlan(_Strict):
    """The planned size of a run, as its creator stated it (``run create --tokens`` or
    ``--rounds``). The inner schedule is derived from it and signed beside it
    (``train.schedule``, ADR 0053): ``inner.total_steps`` is ``rounds × inner_steps``, the
    global step a learner's lr follows when the run certifies its last planned version."""

    rounds: int = Field(ge=1, le=10**7)  # planned certified versions (outer rounds)
    # Planned tokens, every learner together: rounds × learners × H × batch_size × seq_len.
    tokens: NonNegInt
    learners: int = Field(ge=1, le=1_000_000)  # learners a round is planned to merge


class HeldOut(_Strict):
    """The held-out split a run's committees evaluate each state they certify on (ADR 0059).

    The corpus puts ``fraction`` of its documents (by a hash of their names, at least one
    batch's rows: ``train.data.build_corpus``) into the eval split, which no learner trains on;
    of its rows, ``batches`` × the inner batch size rows are drawn by ``seed``
    (``train.data.held_out_batches``): the same rows for every version and every syncer. A
    signer takes the leader's loss if it is within ``tolerance`` × max(1, its own loss) of
    its own value."""

    fraction: float = Field(default=0.05, gt=0, lt=1)
    batches: int = Field(default=4, ge=1, le=1024)
    seed: NonNegInt = 0
    tolerance: float = Field(default=1e-3, ge=0, le=1)


class RunManifest(_Strict):
    """Body of a ``manifest`` record: everything that defines a training run.

    The run id is derived from the manifest (:func:`run_id_of`), so the envelope's run field is
    empty. ``quorum`` defaults to :func:`default_quorum` of ``committee_size``.
    """

    protocol_version: int = Field(ge=1, le=2**31)
    name: Name
    model: Text = Field(min_length=1)
    data: Text = Field(min_length=1)
    seed: NonNegInt
    creator: PeerIdStr
    created_at: NonNegFloat
    committee_size: int = Field(ge=1, le=64)
    quorum: int = Field(ge=1, le=64)
    inner_steps: int = Field(ge=1, le=10**7)
    # Seconds of inner steps per delta (mixed hardware): a learner sends once it has trained this
    # long or ``inner_steps`` steps, whichever comes first; None: every delta is H steps.
    time_budget: float | None = Field(default=None, gt=0, le=86_400)
    inner: InnerParams = Field(default_factory=InnerParams)
    outer: OuterParams = Field(default_factory=OuterParams)
    compression: RuleName = "none"  # delta codec, one of ``p2pdiloco.compress.CODECS``
    rules: SyncRules = Field(default_factory=SyncRules)
    # The committee of round 1, when no certificate exists yet to draw one from; empty means
    # the creator alone. Also the fallback if a certified roster ever empties.
    genesis_committee: list[PeerIdStr] = Field(default_factory=list, max_length=64)
    # The planned size behind the inner schedule (ADR 0053); None: a run made without one,
    # which keeps the default schedule (and the bytes, run id and signature of before).
    plan: RunPlan | None = None
    # The held-out split each certified state is evaluated on (ADR 0059); None: certificates
    # carry no eval loss, and the manifest keeps its bytes, run id and signature of before.
    held_out: HeldOut | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A manifest without a plan or a held-out split serialises, hashes and signs exactly
        # as before they existed: its run id stays the one every node already knows.
        data: dict[str, Any] = handler(self)
        for key in ("plan", "held_out"):
            if getattr(self, key) is None:
                data.pop(key, None)
        return data

    @model_validator(mode="before")
    @classmethod
    def _fill_quorum(cls, data: Any) -> Any:
        if isinstance(data, dict) and "quorum" not in data:
            k = data.get("committee_size")
            if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 64:
                return {**data, "quorum": default_quorum(k)}
        return data

    @model_validator(mode="after")
    def _quorum_fits(self) -> Self:
        if self.quorum > self.committee_size:
            raise ValueError(f"quorum {self.quorum} exceeds committee size {self.committee_size}")
        return self

    @model_validator(mode="after")
    def _plan_sets_the_horizon(self) -> Self:
        if self.plan is not None and self.inner.total_steps != self.plan.rounds * self.inner_steps:
            raise ValueError(
                f"inner.total_steps {self.inner.total_steps} is not the plan's "
                f"{self.plan.rounds} rounds × {self.inner_steps} inner steps"
            )
        return self

    @field_validator("genesis_committee")
    @classmethod
    def _genesis_unique(cls, peers: list[str]) -> list[str]:
        if len(set(peers)) != len(peers):
            raise ValueError("the genesis committee must not repeat a peer")
        return peers


def run_id_of(manifest: RunManifest) -> str:
    """The run id: 64 hex chars of sha256 over the domain tag and the canonical manifest.

    Independent of key order; any change to any field gives another id.
    """
    return run_id_of_body(manifest.model_dump(mode="json"))


def run_id_of_body(body: dict[str, Any]) -> str:
    """The run id of a manifest body as signed (JSON form): equal to :func:`run_id_of` for a
    manifest this build made, and computable for one of another protocol version."""
    return hashlib.sha256(_RUN_ID_DOMAIN + canonical_json(body)).hexdigest()


def parse_manifest(env: Envelope) -> tuple[str, RunManifest]:
    """The run id and typed manifest of a verified envelope.

    Raises IncompatibleProtocol if the manifest declares another protocol version (checked
    first, since a newer manifest may carry fields this version does not know); InvalidRecord
    if the envelope is not a manifest, its run field is not empty, the body fails the schema,
    or its ``creator`` is not the signer.
    """
    if env.kind != MANIFEST_KIND:
        raise InvalidRecord(f"expected a manifest, got {env.kind[:64]!r}", signer=env.signer)
    if env.run != "":
        raise InvalidRecord("a manifest's envelope run field must be empty", signer=env.signer)
    version = env.body.get("protocol_version")
    if isinstance(version, int) and not isinstance(version, bool) and version != PROTOCOL_VERSION:
        raise IncompatibleProtocol(_incompatible_message(env.body.get("name"), version))
    manifest = typed_body(env, RunManifest, "manifest", "creator")
    return run_id_of(manifest), manifest


def _incompatible_message(name: object, version: int) -> str:
    label = name[:64] if isinstance(name, str) and name.isprintable() else "?"
    shown = version if abs(version) < 10**9 else "?"
    head = (
        f"run {label!r} uses protocol version {shown} "
        f"but this p2pdiloco speaks version {PROTOCOL_VERSION}"
    )
    if version > PROTOCOL_VERSION:
        return f"{head}; upgrade with: pip install -U p2pdiloco"
    return f"{head}; join it with an older p2pdiloco release or create a new run"
