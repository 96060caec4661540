"""Reason codes: why an input was refused or a request failed.

Every rejection and every sync RPC error carries one ``Reason`` plus human text. Code branches
on the code, never on the text; the text is for logs and dashboards. Codes travel on the wire
as their string value, so a value is never renamed once released (add a new one instead).
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    # -- a submission, screened by a syncer --------------------------------------------------
    INVALID_SIGNATURE = "invalid_signature"  # envelope or signature does not verify
    MALFORMED = "malformed"  # schema, framing or payload format is wrong
    DIGEST_MISMATCH = "digest_mismatch"  # payload does not match the signed header
    WRONG_CODEC = "wrong_codec"  # not the run's codec
    WRONG_FRAGMENT = "wrong_fragment"  # fragment layout not the run's
    WRONG_RUN = "wrong_run"  # for another run
    REPLAYED = "replayed"  # this exact signed submission was already received
    DUPLICATE = "duplicate"  # a second submission from one learner in one round
    ROUND_CLOSED = "round_closed"  # the round already closed its input set
    NOT_ON_COMMITTEE = "not_on_committee"  # this syncer is not on the round's committee
    BASE_TOO_NEW = "base_too_new"  # base version newer than this syncer holds (retry later)
    STALE = "stale"  # base version older than the staleness bound
    BAD_CLAIM = "bad_claim"  # steps/tokens claim impossible or implausible
    NO_STATE = "no_state"  # this syncer has no certified state yet
    SCREENED_OUT = "screened_out"  # dropped by norm/finite screening at aggregation
    NO_PAYLOAD = "no_payload"
    # -- committee messages -------------------------------------------------------------------
    OVER_PROBATION = "over_probation"  # an input set with more probationary inputs than allowed
    NOT_LEADER = "not_leader"  # proposal from a syncer that is not the current leader
    NOT_IN_INPUT_SET = "not_in_input_set"  # fetched submission outside the agreed set
    OUTSIDE_COMMITTEE = "outside_committee"  # signature from outside the committee
    WRONG_COMMITTEE = "wrong_committee"  # a body naming another committee
    EQUIVOCATION = "equivocation"  # signed two different states in one round
    EVAL_MISMATCH = "eval_mismatch"  # a leader's eval loss outside the tolerance (ADR 0059)
    NO_OPEN_ROUND = "no_open_round"  # no round for that version open here (yet)
    # -- requests -----------------------------------------------------------------------------
    UNKNOWN_OP = "unknown_op"
    NOT_FOUND = "not_found"  # no such certificate, state, chunk or submission here
    OUT_OF_RANGE = "out_of_range"
    BUSY = "busy"  # too many concurrent requests; retry later
    INTERNAL = "internal"  # a bug on the answering side
    UNREACHABLE = "unreachable"  # the caller could not reach the peer (transport failure)
    # -- appended after the first release ---------------------------------------------------
    MERGE_FAILED = "merge_failed"  # this syncer could not merge the agreed set; it was dropped
    # -- DHT records, refused at store time or when read (net.record_rules) ---------------------
    UNKNOWN_KIND = "unknown_kind"  # a record kind no DHT slot holds
    WRONG_SLOT = "wrong_slot"  # key or subkey is not the one the record's content names
    WRONG_SIGNER = "wrong_signer"  # the body speaks for a peer other than its signer
    BAD_TIMESTAMP = "bad_timestamp"  # signed time outside the window around local time
    BAD_EXPIRY = "bad_expiry"  # expiry beyond the record type's TTL from now
    OVER_QUOTA = "over_quota"  # the signer already fills its share of this node's storage
    UNVERIFIED = "unverified"  # a certificate not verifiable by its chain: its version is ignored
    # -- certified updates (ADR 0029) ------------------------------------------------------
    STATE_MISMATCH = "state_mismatch"  # a certified update does not give the certified state

    @classmethod
    def parse(cls, value: object) -> Reason:
        """The code of a value received from a peer; unknown values map to MALFORMED."""
        try:
            return cls(str(value))
        except ValueError:
            return cls.MALFORMED


# Codes after which a learner should send the same submission again later.
RETRYABLE = frozenset({Reason.BASE_TOO_NEW, Reason.NO_OPEN_ROUND, Reason.BUSY, Reason.UNREACHABLE})

# Codes that say a submission came at the wrong time, not that it was bad: an honest learner
# gets them whenever its delta arrives after its round closed or at a syncer that moved on
# (STALE: one or more versions on, past the staleness bound, 0 by default).
TIMING = frozenset(
    {
        Reason.ROUND_CLOSED,
        Reason.STALE,
        Reason.NOT_ON_COMMITTEE,
        Reason.BASE_TOO_NEW,
        Reason.NO_OPEN_ROUND,
    }
)
