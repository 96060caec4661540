"""Domain-separated, run-bound signatures over canonical JSON envelopes.

An envelope is the canonical JSON object
``{"v":1,"kind":..,"run":..,"signer":<peer id>,"ts":<unix s>,"body":{..},"sig":<hex>}`` where
``sig`` is the signer's Ed25519 signature of
``signing_message(kind, run, canonical_json(envelope without "sig"))``. Binding the kind and the
run into the signed message means a signature made for one kind or run never verifies for
another, even if a relay re-labels the fields.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from p2pdiloco.errors import UserError
from p2pdiloco.protocol.identity import (
    Identity,
    IdentityError,
    public_key_from_peer_id,
    verify,
)

# The run protocol (manifest fields and their meaning): a manifest of another version is
# refused with an upgrade message. 2: sync rules moved into ``RunManifest.rules``. 3: views
# (a certificate names its view and carries the timeout certificates of earlier views).
# 4: trust (``rules.trust_min_accepted``, ``trust_min_age``, ``probation_share``; core.trust).
# 5: committee recency (``rules.committee_recency``: only recent contributors are elected).
# 6: norm screening compares each delta with the median of the others (leave-one-out,
# ADR 0027): a round's verdicts, and so its certified bytes, differ from protocol 5's.
# 7: certified updates (ADR 0029): ``rules.update_codec``, the outer step applies the decoded
# update, and certificate bodies carry ``update_hash``; the ``update`` op serves it.
# 8: clone folding (ADR 0036): ``rules.clone_factor``; near-identical deltas merge as one row.
# 9: derived rosters (ADR 0044): a certificate body carries ``roster_hash``, not the roster,
# and a roster holds up to 65,536 identities; ``rules.roster_window`` (ADR 0045, 10 versions,
# was 3).
# 10: receipts that scale (ADR 0047): a certificate lists up to 16,384 receipts (was 4,096),
# a proposal as many digests; certificates and signature messages may be up to 8 MiB.
# 11: views that fit the live network (ADR 0055: short-committee quorums, votes carry their
# lock, a certificate carries one TC, no last view, the pacemaker's `rules.view_timeout_max`),
# the certified eval loss (ADR 0059: `held_out`, `eval_loss`), work scoring (ADR 0062:
# `rules.work`) and sparse certified updates (ADR 0064: `update_form`, `update_k`,
# `params_hash`). Manifests that name none of the new fields keep their bytes and run id.
# 12: with work scoring, a replay of the last certified update is named a replay whichever
# screen refused it first (ADR 0062): a round's rejection reasons differ from protocol 11's.
# 13: with work scoring, a trusted delta that shows no advantage on its own data is merged
# without credit (ADR 0065): a receipt may carry 0 tokens, and such a one is no receipt.
# 14: with work scoring, an input set always has room for one probationary delta, and a round
# whose only trusted deltas show no work merges them without credit once trust is earned
# (ADR 0066): the input sets and certificates of young runs differ from protocol 13's.
# 15: a committee of fewer than three that holds a founder is the founders alone (ADR 0073):
# the committees of young and small runs differ from protocol 14's.
# 16: with work scoring, a group of copies in which none shows work is merged uncredited as
# its trusted members, not refused whole (ADR 0074): a round's verdicts differ from 15's.
PROTOCOL_VERSION = 16
# The envelope format ("v"), versioned apart so an old node still opens a newer run's
# manifest envelope and can say which protocol it speaks.
ENVELOPE_VERSION = 1
DEFAULT_MAX_BYTES = 64 * 1024
_DOMAIN = b"p2pdiloco/v1\x00"
_MAX_KIND_LEN = 64
_MAX_RUN_LEN = 128


class InvalidRecord(UserError):
    """A record from a peer that fails a check; it must be dropped (and logged), never applied.

    ``signer`` is the peer id the record claims, if it got far enough to name one;
    ``signer_verified`` is true only when the signature checked out, so only then may the
    failure be held against that peer (anyone can claim any signer id).
    """

    def __init__(self, reason: str, *, signer: str | None = None, signer_verified: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.signer = signer
        self.signer_verified = signer_verified


def canonical_json(obj: Any) -> bytes:
    """Deterministic UTF-8 JSON: sorted keys, no spaces, no NaN/Infinity.

    Raises ValueError on NaN/Infinity and TypeError on values JSON cannot represent.
    """
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _len_prefixed(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def signing_message(kind: str, run_id: str, body: bytes) -> bytes:
    """The exact bytes signed for a record of ``kind`` in run ``run_id`` with content ``body``."""
    return (
        _DOMAIN
        + _len_prefixed(kind.encode())
        + _len_prefixed(run_id.encode())
        + hashlib.sha256(body).digest()
    )


def _check_peer_id(value: str) -> str:
    if (error := _peer_id_error(value)) is not None:
        raise ValueError(error)
    return value


@lru_cache(maxsize=1 << 16)
def _peer_id_error(value: str) -> str | None:
    """Why ``value`` is no Ed25519 peer id (None: it is one). Every signed message names peer
    ids, mostly the same few thousand: decoding each again was a twentieth of a 10,000-peer
    simulation."""
    try:
        public_key_from_peer_id(value)
    except IdentityError as e:
        return str(e)
    return None


PeerIdStr = Annotated[str, Field(min_length=40, max_length=64), AfterValidator(_check_peer_id)]


class _EnvelopeModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)

    v: Literal[1]
    kind: str = Field(min_length=1, max_length=_MAX_KIND_LEN)
    run: str = Field(max_length=_MAX_RUN_LEN)
    signer: PeerIdStr
    ts: float = Field(ge=0)
    body: dict[str, Any]
    sig: str = Field(pattern=r"^[0-9a-f]{128}$")


@dataclass(frozen=True)
class Envelope:
    """A verified record: who signed it, when, for which kind and run, and its (untyped) body.

    ``raw`` is the exact canonical bytes that were verified, fit to store and relay as is.
    """

    kind: str
    run: str
    signer: str
    ts: float
    body: dict[str, Any] = field(repr=False)
    raw: bytes = field(repr=False)

    @property
    def public_key(self) -> bytes:
        """The signer's 32-byte Ed25519 public key (embedded in its peer id)."""
        return public_key_from_peer_id(self.signer)

    @property
    def digest(self) -> str:
        """Hex sha256 of ``raw``: a unique id of this exact signed record."""
        return hashlib.sha256(self.raw).hexdigest()


def seal(
    identity: Identity,
    kind: str,
    run_id: str,
    body: Mapping[str, Any],
    *,
    ts: float | None = None,
) -> bytes:
    """Sign ``body`` as a ``kind`` record of run ``run_id``; returns the envelope bytes.

    ``ts`` defaults to now. Raises ValueError if kind/run are empty or too long, or if ``ts`` or
    the body holds NaN/Infinity; TypeError if the body is not JSON-representable.
    """
    if not 1 <= len(kind) <= _MAX_KIND_LEN:
        raise ValueError(f"kind must be 1..{_MAX_KIND_LEN} characters")
    if len(run_id) > _MAX_RUN_LEN:
        raise ValueError(f"run id must be at most {_MAX_RUN_LEN} characters")
    stamp = time.time() if ts is None else float(ts)
    if not math.isfinite(stamp) or stamp < 0:
        raise ValueError("ts must be a finite, non-negative unix time")
    unsigned = {
        "v": ENVELOPE_VERSION,
        "kind": kind,
        "run": run_id,
        "signer": identity.peer_id,
        "ts": stamp,
        # Round-trip through JSON so the signed content is exactly what a receiver will parse
        # (tuples become lists, int subclasses become ints, ...).
        "body": json.loads(canonical_json(dict(body))),
    }
    sig = identity.sign(signing_message(kind, run_id, canonical_json(unsigned)))
    return canonical_json({**unsigned, "sig": sig.hex()})


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return out


def schema_error_reason(what: str, err: ValidationError) -> str:
    """A one-line, bounded description of the first schema violation (never echoes the input)."""
    first = err.errors(include_url=False, include_input=False)[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<root>"
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"bad {what}: {loc}: {first['msg']}"[:300] + more


M = TypeVar("M", bound=BaseModel)


def typed_body(env: Envelope, model: type[M], what: str, speaker: str) -> M:
    """``env``'s body validated as ``model``, whose field ``speaker`` must name the signer (a
    peer may only speak for itself). Raises InvalidRecord naming the signer: a schema error,
    or a body speaking for another peer (then ``signer_verified``, the signer is to blame)."""
    try:
        body = model.model_validate(env.body)
    except ValidationError as e:
        raise InvalidRecord(schema_error_reason(what, e), signer=env.signer) from None
    if getattr(body, speaker) != env.signer:
        raise InvalidRecord(
            f"{what} {speaker} differs from its signer", signer=env.signer, signer_verified=True
        )
    return body


def open_envelope(
    raw: bytes,
    *,
    kind: str | None = None,
    run_id: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    now: float | None = None,
    max_skew: float = 120.0,
    max_age: float | None = None,
) -> Envelope:
    """Verify untrusted envelope bytes and return the envelope.

    Checks, in this order, raising InvalidRecord with a one-line reason at the first failure:
    ``raw`` is bytes; at most ``max_bytes`` long (before any parsing); a UTF-8 JSON object in
    canonical form; the envelope schema (v == 1, valid Ed25519 signer peer id, finite ts, 128
    hex sig, no extra fields); ``kind`` and ``run_id`` match when given; the signature is valid;
    ts is at most ``max_skew`` seconds ahead of ``now``; when ``max_age`` is given, ts is at
    most ``max_age`` seconds behind ``now``. ``now`` defaults to the current time.
    """
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise InvalidRecord(f"record must be bytes, not {type(raw).__name__}")
    if len(raw) > max_bytes:
        raise InvalidRecord(f"record too large: {len(raw)} bytes > limit {max_bytes}")
    data = bytes(raw)
    try:
        obj = json.loads(
            data.decode("utf-8"),
            parse_constant=_reject_constant,
            object_pairs_hook=_no_duplicate_keys,
        )
    except UnicodeDecodeError:
        raise InvalidRecord("record is not UTF-8") from None
    except (ValueError, RecursionError) as e:
        raise InvalidRecord(f"record is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(obj, dict):
        raise InvalidRecord("record is not a JSON object")
    # One record, one byte string: otherwise a relay could re-encode a signed record into
    # endless distinct-looking copies that defeat de-duplication by hash.
    try:
        canonical = canonical_json(obj)
    except ValueError:
        # e.g. 1e999 parses to inf, or an escaped lone surrogate cannot be UTF-8 encoded
        raise InvalidRecord("record holds a value outside canonical JSON") from None
    if canonical != data:
        raise InvalidRecord("record is not in canonical JSON form")

    try:
        model = _EnvelopeModel.model_validate(obj)
    except ValidationError as e:
        claimed = obj.get("signer")
        raise InvalidRecord(
            schema_error_reason("envelope", e),
            signer=claimed if isinstance(claimed, str) and len(claimed) <= 64 else None,
        ) from None
    signer = model.signer

    if kind is not None and model.kind != kind:
        raise InvalidRecord(f"expected a {kind!r} record, got {model.kind[:64]!r}", signer=signer)
    if run_id is not None and model.run != run_id:
        raise InvalidRecord(
            f"record is for run {model.run[:16]!r}, expected {run_id[:16]!r}", signer=signer
        )

    unsigned = {k: v for k, v in obj.items() if k != "sig"}
    message = signing_message(model.kind, model.run, canonical_json(unsigned))
    if not verify(public_key_from_peer_id(signer), message, bytes.fromhex(model.sig)):
        raise InvalidRecord("bad signature", signer=signer)

    clock = time.time() if now is None else now
    if model.ts > clock + max_skew:
        raise InvalidRecord(
            f"timestamp {model.ts - clock:.0f} s in the future (max skew {max_skew:g} s)",
            signer=signer,
            signer_verified=True,
        )
    if max_age is not None and model.ts < clock - max_age:
        raise InvalidRecord(
            f"record too old: {clock - model.ts:.0f} s > max age {max_age:g} s",
            signer=signer,
            signer_verified=True,
        )
    return Envelope(
        kind=model.kind, run=model.run, signer=signer, ts=model.ts, body=model.body, raw=data
    )


class ReplayGuard:
    """Rejects records not newer than the last accepted one from the same (kind, run, signer).

    Memory is bounded: beyond ``max_keys`` the least recently updated keys are forgotten, so a
    forgotten key's old records pass again; pair with ``open_envelope(max_age=...)`` to bound
    that window. Not thread-safe: use from one thread or event loop.
    """

    def __init__(self, max_keys: int = 100_000) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self._max_keys = max_keys
        self._last: OrderedDict[tuple[str, str, str], float] = OrderedDict()

    def check(self, env: Envelope) -> None:
        """Record ``env`` as seen; raises InvalidRecord("replayed ...") if ``env.ts`` is not
        greater than the last accepted ts for its (kind, run, signer)."""
        key = (env.kind, env.run, env.signer)
        last = self._last.get(key)
        if last is not None and env.ts <= last:
            raise InvalidRecord(
                f"replayed or stale {env.kind!r} record (ts {env.ts:.3f} <= last {last:.3f})",
                signer=env.signer,
                signer_verified=True,
            )
        self._last[key] = env.ts
        self._last.move_to_end(key)
        while len(self._last) > self._max_keys:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)
