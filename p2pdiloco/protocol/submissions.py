"""A learner's submission: a signed header that commits to the compressed delta by hash.

The header is a small signed envelope (kind ``submission``, run = run id) and travels apart from
the payload, which may be gigabytes split into fragments. The header names each fragment's sha256
and size, so a syncer can accept the bytes from anyone (the learner, a fellow syncer, a relay) and
check them against what the learner signed. The envelope digest (sha256 of the exact signed
bytes) is the submission's id: it is what the committee agrees on and what a certificate's
``accepted`` / ``rejected`` lists name.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from p2pdiloco.protocol.certificates import Hex64
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import NonNegInt, RuleName
from p2pdiloco.protocol.signing import (
    Envelope,
    InvalidRecord,
    PeerIdStr,
    open_envelope,
    seal,
    typed_body,
)

SUBMISSION_KIND = "submission"
# With work scoring, the certified versions before a delta's base whose assigned rows it may
# say it trained on (``SubmissionHeader.data_version``, ADR 0066): a stretch keeps its rows
# through the rebases of rounds that close while it trains.
DATA_LAG = 4
MAX_SUBMISSION_HEADER_BYTES = 16 * 1024
MAX_FRAGMENTS = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


class FragmentRef(_Strict):
    """One fragment of the compressed delta: its index in the run's fragment plan, hash, size."""

    index: int = Field(ge=0, lt=MAX_FRAGMENTS)
    digest: Hex64  # sha256 hex of the fragment's payload bytes
    nbytes: int = Field(ge=0, le=2**40)


class SubmissionHeader(_Strict):
    """Body of a ``submission`` record: what a learner claims about one outer delta."""

    peer_id: PeerIdStr  # must equal the envelope signer
    base_version: NonNegInt  # certified version the learner trained from
    steps: int = Field(ge=1, le=10**9)  # inner steps taken since base_version
    tokens: int = Field(ge=1, le=10**15)  # tokens trained on; checked against steps by syncers
    loss: float = Field(ge=0, le=1e4)  # mean inner training loss over the round
    codec: RuleName  # compression codec of the payload ("none", "fp16", "int8", "int4")
    fragments: list[FragmentRef] = Field(min_length=1, max_length=MAX_FRAGMENTS)
    # With work scoring: the version whose assigned rows the delta trained on (ADR 0066),
    # from base_version − DATA_LAG to base_version + 1; None (omitted): base_version.
    data_version: NonNegInt | None = None

    @model_validator(mode="after")
    def _fragments_increasing(self) -> Self:
        indices = [f.index for f in self.fragments]
        if any(a >= b for a, b in zip(indices, indices[1:], strict=False)):
            raise ValueError("fragment indices must be unique and increasing")
        return self

    @model_validator(mode="after")
    def _data_version_near_base(self) -> Self:
        d, b = self.data_version, self.base_version
        if d is not None and not b - DATA_LAG <= d <= b + 1:
            raise ValueError(
                f"data version {d} is not within {DATA_LAG} versions before base {b} (or {b + 1})"
            )
        return self

    @property
    def rows_version(self) -> int:
        """The version whose assigned rows the delta trained on (``data_version``)."""
        return self.base_version if self.data_version is None else self.data_version

    def fragment(self, index: int) -> FragmentRef | None:
        """The reference of fragment ``index``, or None if this submission does not carry it."""
        return next((f for f in self.fragments if f.index == index), None)


def payload_digest(payload: bytes) -> str:
    """Hex sha256 of a fragment's payload bytes, as written in :class:`FragmentRef.digest`."""
    return hashlib.sha256(payload).hexdigest()


def seal_submission(
    identity: Identity, run_id: str, header: SubmissionHeader, *, ts: float | None = None
) -> bytes:
    """Sign ``header`` as a submission of run ``run_id``; returns the envelope bytes.

    Raises ValueError if ``header.peer_id`` is not ``identity``'s peer id (receivers would
    reject it) or if the signed header exceeds MAX_SUBMISSION_HEADER_BYTES: each fragment
    reference costs up to ~113 bytes, so about 140 fit, not the schema's 1024; a plan with more
    fragments must submit them in several headers.
    """
    if header.peer_id != identity.peer_id:
        raise ValueError("submission header peer_id must be the signing identity's peer id")
    raw = seal(
        identity, SUBMISSION_KIND, run_id, header.model_dump(mode="json", exclude_none=True), ts=ts
    )
    if len(raw) > MAX_SUBMISSION_HEADER_BYTES:
        raise ValueError(
            f"signed submission header is {len(raw)} bytes > limit {MAX_SUBMISSION_HEADER_BYTES}"
        )
    return raw


@dataclass(frozen=True)
class ParsedSubmission:
    """A verified submission header; the payload bytes are checked separately per fragment."""

    envelope: Envelope
    header: SubmissionHeader

    @property
    def digest(self) -> str:
        """Hex sha256 of the exact signed bytes: the id of this submission."""
        return self.envelope.digest

    def check_fragment(self, index: int, payload: bytes) -> FragmentRef:
        """The header's reference for fragment ``index`` if ``payload`` matches it.

        Raises InvalidRecord if the header has no such fragment, or the size or hash differs.
        The payload may come from anyone, so a mismatch is not held against the signer
        (``signer_verified`` stays false): fetch the fragment elsewhere.
        """
        ref = self.header.fragment(index)
        if ref is None:
            raise InvalidRecord(f"submission has no fragment {index}", signer=self.header.peer_id)
        if len(payload) != ref.nbytes:
            raise InvalidRecord(
                f"fragment {index} is {len(payload)} bytes, header says {ref.nbytes}",
                signer=self.header.peer_id,
            )
        if payload_digest(payload) != ref.digest:
            raise InvalidRecord(
                f"fragment {index} does not match its signed digest", signer=self.header.peer_id
            )
        return ref


def open_submission(
    raw: bytes, *, run_id: str, now: float | None = None, max_skew: float = 120.0
) -> ParsedSubmission:
    """Verify untrusted submission header bytes for run ``run_id``.

    Runs every envelope check of :func:`open_envelope` (size first, at most
    MAX_SUBMISSION_HEADER_BYTES; kind ``submission``; the run; the signature; clock skew), then
    the header schema, then that the header's ``peer_id`` is the signer. Raises InvalidRecord
    with a one-line reason and the claimed signer at the first failure; ``signer_verified`` is
    true only for a validly signed header that names another peer. Staleness of
    ``base_version`` and the token claim are the round's business, not checked here.
    """
    env = open_envelope(
        raw,
        kind=SUBMISSION_KIND,
        run_id=run_id,
        max_bytes=MAX_SUBMISSION_HEADER_BYTES,
        now=now,
        max_skew=max_skew,
    )
    header = typed_body(env, SubmissionHeader, "submission", "peer_id")
    return ParsedSubmission(envelope=env, header=header)
