"""One outer round on one syncer, as a sans-IO state machine.

The machine never touches the network, the clock or tensors: a driver feeds it events (a
submission arrived, the leader proposed an input set, the aggregate was computed or could not
be, a fellow syncer signed, time passed) and carries out the actions it returns (reject and
log, fast-forward a stale learner, propose, fetch, aggregate, forget dropped payloads, sign,
publish a certificate). The asyncio node, the multi-process tests and a discrete-event
simulator of thousands of peers all drive this class. Its vocabulary lives in
``core/round_types.py`` and is re-exported here.

Phases of the round that turns certified version v into v+1:

    COLLECTING  submissions are screened (run, base version, token claim, duplicates); the
                attempt closes ``linger`` seconds after ceil(min_fraction × trusted live
                learners) trusted submissions are accepted (ADR 0035; at once when every
                active learner is in; a full round refuses more with BUSY until then),
                or ``grace`` seconds after the attempt opened, with at least one;
    AGREEING    the leader proposes the sorted digests of its accepted submissions; the others
                adopt that set, fetching what they miss;
    AGGREGATING the driver merges exactly that set (weights from ``weights()``) and reports the
                resulting state hash, or that the merge failed;
    SIGNING     signatures over (run, v+1, state hash) are collected; q = floor(2k/3)+1 matching
                ones certify the version, whatever this syncer computed itself;
    CERTIFIED   done. ``Done`` actions carry the certified hash and its signers.

Attempts. A syncer that cannot merge the agreed set (screening refused every delta, or a local
error) calls ``on_merge_failed``: it signs nothing for that set, drops its submissions (they
are refused if sent again) and opens attempt n+1 in COLLECTING with a fresh grace period.
Committee member n mod k, and only it, leads attempt n: no rotation by time (members whose
clocks disagree on whose turn it is would each sign their own set); a silent leader
(``leader_silent``) makes the driver vote for the next view (``core/views.py``, ADR 0012), and
a round of a later view may be ``locked`` to the input set an earlier view may have certified.
Proposals name their attempt; one for another attempt is refused with NO_OPEN_ROUND
(retryable), never adopted. Signatures do not name the attempt, so they count in every phase:
if the others merged and reached quorum, a syncer that failed still learns the certified hash
(``Done(agreed_with_quorum=False)``). A syncer signs at most one state in a round (one view of
a version): once it has signed, a later attempt that aggregates to another hash signs nothing,
and once it voted to leave the view (``abandon``) it signs nothing more.

Claims. A header's tokens must fit its steps (steps × batch × seq_len) or it is refused with
BAD_CLAIM; a steps claim above one delta's worth (``max_steps``, the manifest's H) is clipped,
tokens scaled alike (``plausible_claim``), and the clipped claim is what weighs and what the
certificate credits (a ``Clipped`` action tells the driver).

Stale submissions (base older than v − staleness) are rejected and their sender fast-forwarded;
fresher-but-behind ones (v − staleness ≤ base < v) are accepted at weight 1/(1 + v − base).

Memory is bounded whatever peers send: at most ``max_inputs`` accepted submissions (more are
refused with BUSY), at most ``max_dropped`` dropped digests, one signature per committee member.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from p2pdiloco.core.reach import Reach
from p2pdiloco.core.round_types import (
    Action,
    Aggregate,
    Clipped,
    Done,
    Dropped,
    Evaluated,
    FastForward,
    Fetch,
    Phase,
    Propose,
    Reject,
    RoundParams,
    Sign,
    Standing,
    Submission,
    SubmissionStatus,
)
from p2pdiloco.core.trust import cap_probation
from p2pdiloco.core.weights import merge_weights, plausible_claim
from p2pdiloco.protocol.reasons import Reason

Refusal = tuple[Reason, str]  # why a submission is refused: code and one line

__all__ = [
    "Action",
    "Aggregate",
    "Clipped",
    "Done",
    "Dropped",
    "Evaluated",
    "FastForward",
    "Fetch",
    "Phase",
    "Propose",
    "Reject",
    "RoundParams",
    "Sign",
    "Standing",
    "Submission",
    "SubmissionStatus",
    "SyncerRound",
]


@dataclass
class SyncerRound:
    """The round as seen by syncer ``me`` (one of ``params.committee``)."""

    params: RoundParams
    me: str
    phase: Phase = Phase.COLLECTING
    attempt: int = 0  # bumped by every failed merge on this syncer
    attempt_opened_at: float = field(init=False)  # grace counts from here (params.opened_at)
    accepted: dict[str, Submission] = field(default_factory=dict)  # by digest, ≤ max_inputs
    by_peer: dict[str, str] = field(default_factory=dict)  # learner → its accepted digest
    dropped: dict[str, Reason] = field(default_factory=dict)  # digest → code, ≤ max_dropped
    closed_at: float | None = None  # when this attempt stopped collecting
    enough_at: float | None = None  # when this attempt first reached the learner quorum
    reach: Reach = field(default_factory=Reach)  # fellows the driver failed to dial (ADR 0041)
    input_set: tuple[str, ...] | None = None
    # ``input_set`` as a set, for membership (built once per set, not once per question)
    _agreed_of: tuple[str, ...] | None = field(default=None, repr=False, compare=False)
    _agreed_set: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    own_hash: str | None = None  # the state this syncer signed; set once per version
    last_hash: str | None = None  # the state of this syncer's latest successful merge
    signatures: dict[str, str] = field(default_factory=dict)  # syncer → state hash
    abandoned: bool = False  # voted to hand the version to the next view: signs nothing more
    # Of ``accepted``, how many come from untrusted (probationary) senders: kept as submissions
    # come and go, so screening and closing cost O(1) per submission, not O(inputs).
    probationary: int = field(default=0, init=False)
    # Certified eval (ADR 0059): this member's merged content and loss, waiting for the
    # leader's signed body; the leader's body (its digest) and its content and loss.
    own_eval: Evaluated | None = None
    lead_offer: tuple[str, Evaluated] | None = None
    eval_wait_from: float | None = None  # first tick that saw this member waiting for it

    def __post_init__(self) -> None:
        if self.me not in self.params.committee:
            raise ValueError(f"{self.me} is not on this round's committee")
        if not 1 <= self.params.quorum <= len(self.params.committee):
            raise ValueError("quorum must be between 1 and the committee size")
        if self.params.max_inputs < 1 or self.params.max_dropped < 0:
            raise ValueError("max_inputs must be ≥ 1 and max_dropped ≥ 0")
        self.attempt_opened_at = self.params.opened_at
        if (
            self.params.locked is not None
        ):  # agreed already: what an earlier view may have certified
            self.phase, self.input_set = Phase.AGREEING, self.params.locked
            self.closed_at = self.params.opened_at

    # -- events ----------------------------------------------------------------------------

    def on_submission(self, sub: Submission, now: float) -> list[Action]:
        """Screen one submission header; accepted ones wait for the attempt to close. One of
        the agreed input set that this syncer still lacks is taken as if fetched."""
        agreed = self.input_set is not None and sub.digest in self._agreed()
        if agreed and self.phase is Phase.AGREEING and sub.digest not in self.accepted:
            return self.on_fetched(sub)
        refusal = self._screen(sub)
        if refusal is not None:
            actions: list[Action] = [Reject(sub.peer_id, *refusal)]
            if refusal[0] is Reason.STALE:
                actions.append(FastForward(sub.peer_id, self.params.version))
            return actions
        counted = self._accept(sub)
        clipped: list[Action] = []
        if counted is not sub:
            claimed = (sub.steps, sub.tokens)
            clipped.append(
                Clipped(sub.peer_id, sub.digest, claimed, (counted.steps, counted.tokens))
            )
        return clipped + self._maybe_close(now)

    def on_tick(self, now: float) -> list[Action]:
        """Time passed: close at the grace deadline; the leader proposes once closed; a member
        that waited ``agree_timeout`` for the leader's evaluated body signs its own."""
        if self.own_eval is not None and self.own_hash is None:
            return self._stop_waiting(now)
        if self.phase is Phase.COLLECTING:
            return self._maybe_close(now)
        if self.params.locked is not None:
            return []  # nobody proposes a locked set
        if self.phase is Phase.AGREEING and self.leader(now) == self.me and self.accepted:
            return self._propose()
        return []

    def on_proposal(
        self, sender: str, digests: tuple[str, ...], now: float, attempt: int = 0
    ) -> list[Action]:
        """The leader's input set for ``attempt``: adopt it (fetching what is missing) and
        aggregate. Refused with NO_OPEN_ROUND when this syncer is in another attempt (the
        sender retries); ignored once this syncer has adopted or computed a set itself."""
        if self.phase is Phase.CERTIFIED:
            return []
        if sender in self.params.committee:
            self.reach.heard(sender)
        if attempt != self.attempt:
            text = f"proposal for attempt {attempt}, this syncer is in attempt {self.attempt}"
            return [Reject(sender, Reason.NO_OPEN_ROUND, text)]
        if self.phase not in (Phase.COLLECTING, Phase.AGREEING) or self.params.locked is not None:
            return []  # a locked round's set is fixed; a proposal changes nothing
        if sender != self.leader(now):
            text = "proposal from a syncer that is not the current leader"
            return [Reject(sender, Reason.NOT_LEADER, text)]
        if (
            not digests
            or len(digests) > self.params.max_inputs
            or any(a >= b for a, b in itertools.pairwise(digests))  # unsorted or repeated
        ):
            text = "malformed input set (empty, too long, unsorted or repeated)"
            return [Reject(sender, Reason.MALFORMED, text)]
        gone = [d for d in digests if d in self.dropped]
        if gone:
            text = f"input set holds {gone[0][:12]}, which this syncer dropped after a failed merge"
            return [Reject(sender, self.dropped[gone[0]], text)]
        if self.input_set is not None:
            return []  # a copy passed on by a fellow once this member has a set (ADR 0042)
        self.closed_at = self.closed_at if self.closed_at is not None else now
        self.input_set = digests
        self.phase = Phase.AGREEING
        missing = tuple(d for d in digests if d not in self.accepted)
        if missing:
            return [Fetch(missing, sender)]
        return self._adopted(sender)

    def on_fetched(self, sub: Submission) -> list[Action]:
        """A submission fetched from a fellow syncer (header re-checked like any other)."""
        if self.phase is not Phase.AGREEING or self.input_set is None:
            return []
        if sub.digest not in self._agreed():
            text = "fetched submission is not in the agreed input set"
            return [Reject(sub.peer_id, Reason.NOT_IN_INPUT_SET, text)]
        if sub.digest in self.accepted:
            return []  # the learner's own copy came first
        refusal = self._screen(sub, allow_after_close=True)
        if refusal is not None:
            return [Reject(sub.peer_id, *refusal)]
        actions = self._make_room(self.input_set)
        self._accept(sub)
        if self._agreed() <= self.accepted.keys():
            actions += self._adopted(self.leader(0))
        return actions

    def _agreed(self) -> frozenset[str]:
        """The agreed input set's digests (empty before one is agreed)."""
        if self._agreed_of is not self.input_set:
            self._agreed_of, self._agreed_set = self.input_set, frozenset(self.input_set or ())
        return self._agreed_set

    def on_aggregated(
        self, state_hash: str, attempt: int | None = None, evaluated: Evaluated | None = None
    ) -> list[Action]:
        """The driver merged the input set of ``attempt`` (None: the current one) and applied
        the outer step: sign the result, unless this syncer already signed another state for
        this version (then it only waits for the quorum's signatures). In a run that certifies
        an eval loss (``params.eval_tolerance``), a member other than the leader reports its
        body's content and loss (``evaluated``) and signs the leader's body instead, once that
        arrives with the same content and a loss within the tolerance (ADR 0059)."""
        if self.phase is not Phase.AGGREGATING or attempt not in (None, self.attempt):
            return []
        self.phase = Phase.SIGNING
        self.last_hash = state_hash
        if self.own_hash is not None or self.abandoned:
            return []  # at most one signature per view, whatever later attempts compute
        seconds = self.params.eval_tolerance is not None and self.leader(0) != self.me
        if evaluated is not None and seconds:
            self.own_eval = evaluated
            return self._second_leader()
        self.own_hash = state_hash
        actions: list[Action] = [Sign(self.params.version + 1, state_hash)]
        return actions + self.on_signature(self.me, state_hash)

    def on_merge_failed(
        self, now: float, attempt: int | None = None, screened_out: Collection[str] = ()
    ) -> list[Action]:
        """This syncer could not merge the input set of ``attempt`` (None: the current one).

        Nothing is signed for that set. Its submissions are dropped (code SCREENED_OUT for the
        digests in ``screened_out``, MERGE_FAILED for the rest): each sender gets a ``Reject``,
        the driver a ``Dropped`` to forget the payloads, and the digests are refused if sent
        again; their learners may send a different submission to the new attempt. Attempt n+1
        opens at ``now`` in COLLECTING, led first by committee member n+1 (mod k); submissions
        accepted but outside the failed set stay for it. Signatures already received stay
        counted. Called in AGGREGATING (normally), in AGREEING once a set was
        adopted (its missing submissions could not be fetched), or in SIGNING (the driver
        abandons a state it signed: its signature stands, so this syncer will sign nothing else
        for this version). Ignored in any other phase or for another attempt.
        """
        if (
            self.phase not in (Phase.AGREEING, Phase.AGGREGATING, Phase.SIGNING)
            or self.input_set is None
            or attempt not in (None, self.attempt)
            or self.params.locked is not None  # nothing else may be certified: the view times out
        ):
            return []
        failed = self.input_set
        actions: list[Action] = []
        for d in failed:
            code = Reason.SCREENED_OUT if d in screened_out else Reason.MERGE_FAILED
            sub = self._remove(d)
            self._remember_dropped(d, code)
            if sub is not None:
                text = f"dropped from version {self.params.version + 1}: merge failed ({code})"
                actions.append(Reject(sub.peer_id, code, text))
        actions.append(Dropped(failed))
        self.attempt += 1
        self.attempt_opened_at = now
        self.phase = Phase.COLLECTING
        self.closed_at = self.enough_at = self.input_set = self.last_hash = None
        return actions + self._maybe_close(now)

    def on_signature(
        self, syncer: str, state_hash: str, evaluated: Evaluated | None = None
    ) -> list[Action]:
        """A verified signature of a committee member over (run, v+1, state_hash). Counted in
        every phase but CERTIFIED, whatever attempt this syncer is in. The leader's first
        signature with ``evaluated`` (its body's content and eval loss) is the body this
        member signs in a run that certifies an eval loss (``on_aggregated``)."""
        if syncer not in self.params.committee:
            return [
                Reject(syncer, Reason.OUTSIDE_COMMITTEE, "signature from outside the committee")
            ]
        if self.phase is Phase.CERTIFIED:
            return []
        if syncer in self.signatures and self.signatures[syncer] != state_hash:
            text = "signed two different states in one round (equivocation)"
            return [Reject(syncer, Reason.EQUIVOCATION, text)]
        self.signatures[syncer] = state_hash
        self.reach.heard(syncer)
        refused: list[Action] = []
        if evaluated is not None and self.lead_offer is None and syncer == self.leader(0):
            self.lead_offer = (state_hash, evaluated)
            seconded = self._second_leader()
            if any(isinstance(a, Sign) for a in seconded):
                return seconded  # this member's own signature was counted in there
            refused = seconded  # an eval mismatch; the leader's signature still counts
        signers = tuple(sorted(s for s, h in self.signatures.items() if h == state_hash))
        if len(signers) < self.params.quorum:
            return refused
        self.phase = Phase.CERTIFIED
        done = Done(self.params.version + 1, state_hash, signers, self.last_hash == state_hash)
        return [*refused, done]

    def _second_leader(self) -> list[Action]:
        """Certified eval (ADR 0059), once both this member's merge and the leader's body are
        in: sign the leader's body if it holds the content this member merged and a loss
        within ``eval_tolerance`` × max(1, its own loss) of its own; refuse it as
        EVAL_MISMATCH (signing nothing, so the view times out) if the loss is off; sign its
        own body if the content differs, as a member whose merge differs always did."""
        mine, offer, tol = self.own_eval, self.lead_offer, self.params.eval_tolerance
        if mine is None or offer is None or tol is None or self.own_hash is not None:
            return []
        if self.abandoned or self.phase is not Phase.SIGNING or self.last_hash is None:
            return []
        digest, theirs = offer
        self.own_eval = None  # decided once
        if theirs.content != mine.content:
            digest = self.last_hash
        elif abs(theirs.loss - mine.loss) > tol * max(1.0, abs(mine.loss)):
            text = (
                f"eval loss {theirs.loss:.6g} of version {self.params.version + 1} is not within "
                f"{tol:g} of this member's {mine.loss:.6g}"
            )
            return [Reject(self.leader(0), Reason.EVAL_MISMATCH, text)]
        self.own_hash = self.last_hash = digest
        return [Sign(self.params.version + 1, digest), *self.on_signature(self.me, digest)]

    def _stop_waiting(self, now: float) -> list[Action]:
        """No body from the leader ``agree_timeout`` after this member's merge (the leader may
        be gone): sign its own. On one kind of CPU the eval is bit-exact (ADR 0059), so the
        members' own bodies match and a quorum of them certifies without the leader."""
        if self.eval_wait_from is None:
            self.eval_wait_from = now
        if now < self.eval_wait_from + self.params.agree_timeout or self.last_hash is None:
            return []
        if self.abandoned or self.phase is not Phase.SIGNING:
            return []
        self.own_eval = None
        self.own_hash = self.last_hash
        return [
            Sign(self.params.version + 1, self.own_hash),
            *self.on_signature(self.me, self.own_hash),
        ]

    def abandon(self) -> str | None:
        """This syncer votes to hand the version to the next view (``core/views.py``): from
        now on it signs nothing in this round. Returns the state it signed here, if any, which
        its vote must report."""
        self.abandoned = True
        return self.own_hash

    # -- views -----------------------------------------------------------------------------

    def leader(self, now: float) -> str:
        """The one member that proposes in this attempt: member ``attempt`` (mod k). There is
        no rotation by time (two members whose clocks disagree on whose turn it is would each
        sign their own set): a silent leader makes the members vote for the next view
        (``leader_silent``), whose committee has another leader."""
        committee = self.params.committee
        return committee[self.attempt % len(committee)]

    @property
    def undecided(self) -> bool:
        """No input set adopted here yet: a submission may still make this attempt (the leader
        may close later than this member did)."""
        return self.input_set is None and self.phase in (Phase.COLLECTING, Phase.AGREEING)

    @property
    def close_deadline(self) -> float:
        """When this attempt closes at the latest: its grace, or ``close_after`` if sooner."""
        p = self.params
        close_after = p.grace if p.close_after is None else min(p.grace, p.close_after)
        return self.attempt_opened_at + close_after

    def collecting_left(self, now: float) -> float:
        """Seconds until :attr:`close_deadline`; 0 once past it or with an input set."""
        return max(0.0, self.close_deadline - now) if self.undecided else 0.0

    def leader_silent(self, now: float) -> bool:
        """True once no input set was proposed or adopted here ``agree_timeout`` after this
        attempt closed here (or would have: its close deadline, for a member that holds no
        submission and so never closes) and after the leader's own grace deadline (the leader
        may close later than this syncer, at the latest ``grace`` after the attempt opened), or
        after the driver found the leader unreachable (``on_unreachable``, ADR 0038): the
        driver votes to leave the view early. A member of a later view that no learner sent to
        (they send to the view they expect) had no way out before its view timeout, however
        long (tests/test_runtime_views.py saw two members of four wait out 7,200 s)."""
        if self.phase not in (Phase.COLLECTING, Phase.AGREEING) or self.input_set is not None:
            return False
        if self.phase is Phase.COLLECTING and (self.accepted or self.leader(now) == self.me):
            # It closes at its deadline, then waits as below; a leader never finds itself
            # silent (holding nothing, it proposes nothing, and its fellows find it silent).
            return False
        closed = self.closed_at if self.closed_at is not None else self.close_deadline
        gone = self.reach.gone.get(self.leader(now))  # since its first failed dial
        waits = self.attempt_opened_at + self.params.grace if gone is None else gone
        return now >= max(closed, waits) + self.params.agree_timeout

    def on_unreachable(self, peer_id: str, now: float) -> None:
        """The driver could not reach fellow ``peer_id`` (a relay or message failed to connect):
        gone until heard from again. If it leads the attempt, ``leader_silent`` stops waiting for
        its grace deadline (ADR 0038); any fellow counts toward ``quorum_unreachable`` (ADR
        0041)."""
        if peer_id != self.me and peer_id in self.params.committee:
            self.reach.lost(peer_id, now)

    def on_reached(self, peer_id: str) -> None:
        """A message to or from ``peer_id`` went through: it is not gone (any more)."""
        self.reach.heard(peer_id)

    def quorum_unreachable(self, now: float) -> bool:
        """True ``agree_timeout`` after more than k − q fellows were found unreachable (and had
        not signed this member's state): the members left cannot certify this view, so the
        driver votes to leave it now rather than at ``view_timeout`` (ADR 0041)."""
        if self.phase is Phase.CERTIFIED or self.abandoned:
            return False
        mine = self.own_hash
        signed = [s for s, h in self.signatures.items() if mine is None or h == mine]
        since = self.reach.quorum_lost_at(self.params.committee, self.params.quorum, signed)
        return since is not None and now >= since + self.params.agree_timeout

    def weights(self, digests: tuple[str, ...]) -> tuple[float, ...]:
        """Merge weights of accepted ``digests``, in their order (``merge_weights``: tokens
        discounted by staleness, capped per learner; computed over the sorted digests)."""
        v = self.params.version
        entries = {
            d: (self.accepted[d].tokens, v - self.accepted[d].base_version) for d in sorted(digests)
        }
        merged = merge_weights(entries, self.params.weight_cap)
        if self.params.trusted is not None:
            low = frozenset(
                d for d in merged if not self.params.is_trusted(self.accepted[d].peer_id)
            )
            merged = cap_probation(merged, low, self.params.probation_share)
        return tuple(merged[d] for d in digests)

    def status_of(self, digest: str) -> SubmissionStatus:
        """Whether a submission is still held by this round, was dropped (with its code), or is
        unknown here. After CERTIFIED the certificate, not this view, says what was merged."""
        if digest in self.accepted:
            return SubmissionStatus(Standing.PENDING)
        if digest in self.dropped:
            return SubmissionStatus(Standing.DROPPED, self.dropped[digest])
        return SubmissionStatus(Standing.UNKNOWN)

    # -- internals -------------------------------------------------------------------------

    def _screen(self, sub: Submission, allow_after_close: bool = False) -> Refusal | None:
        """Why this round refuses ``sub`` (code and one line), or None to hold it. The checks,
        in order: the run; a digest dropped earlier (its code again); the phase (after the
        close only fetched members of the agreed set pass, ``allow_after_close``); the base
        version (newer than certified, or older than the staleness allows: STALE, and the
        driver fast-forwards the learner); the token claim (steps × batch × seq_len); a
        duplicate digest; then, for a learner's own copy only, one submission per learner,
        ``max_inputs`` and the probationary room (BUSY)."""
        p = self.params
        if sub.run_id != p.run_id:
            return Reason.WRONG_RUN, "submission for another run"
        if sub.digest in self.dropped:
            return self.dropped[sub.digest], "submission was dropped from this round earlier"
        if self.phase is not Phase.COLLECTING and not allow_after_close:
            return Reason.ROUND_CLOSED, f"round for version {p.version + 1} is already closed"
        if sub.base_version > p.version:
            text = f"base version {sub.base_version} is newer than the certified {p.version}"
            return Reason.BASE_TOO_NEW, text
        if sub.base_version < p.version - p.staleness:
            text = f"stale: base version {sub.base_version} is older than {p.version - p.staleness}"
            return Reason.STALE, text
        if sub.steps < 1 or sub.tokens < 1:
            return Reason.BAD_CLAIM, "a submission must report at least one step and one token"
        if sub.tokens > sub.steps * p.max_tokens_per_step:
            text = (
                f"token claim {sub.tokens} exceeds steps × batch × seq_len "
                f"({sub.steps} × {p.max_tokens_per_step})"
            )
            return Reason.BAD_CLAIM, text
        if sub.digest in self.accepted:
            return Reason.DUPLICATE, "duplicate submission"
        if allow_after_close:
            return None
        if sub.peer_id in self.by_peer:
            return Reason.DUPLICATE, "a second submission from the same learner in one round"
        if len(self.accepted) >= p.max_inputs:
            return Reason.BUSY, f"round already holds {p.max_inputs} submissions"
        if not p.is_trusted(sub.peer_id):
            room = max(1, int(p.max_inputs * p.probation_share))
            if self.probationary >= room:
                return Reason.BUSY, f"round already holds {room} probationary submissions"
        return None

    def _accept(self, sub: Submission) -> Submission:
        """Hold ``sub`` with its claim clipped to one delta's steps; return what is held."""
        steps, tokens = plausible_claim(sub.steps, sub.tokens, self.params.max_steps)
        if (steps, tokens) != (sub.steps, sub.tokens):
            sub = replace(sub, steps=steps, tokens=tokens)
        self.accepted[sub.digest] = sub
        self.probationary += not self.params.is_trusted(sub.peer_id)
        self.by_peer.setdefault(sub.peer_id, sub.digest)
        return sub

    def _remove(self, digest: str) -> Submission | None:
        sub = self.accepted.pop(digest, None)
        if sub is not None:
            self.probationary -= not self.params.is_trusted(sub.peer_id)
        if sub is not None and self.by_peer.get(sub.peer_id) == digest:
            del self.by_peer[sub.peer_id]
        return sub

    def _remember_dropped(self, digest: str, code: Reason) -> None:
        self.dropped[digest] = code
        while len(self.dropped) > self.params.max_dropped:
            del self.dropped[next(iter(self.dropped))]  # forget the oldest first

    def _make_room(self, keep: tuple[str, ...]) -> list[Action]:
        """Before a fetched input-set member goes in: when full, evict the oldest accepted
        submission outside the set (one exists: the set itself holds at most max_inputs)."""
        if len(self.accepted) < self.params.max_inputs:
            return []
        wanted = set(keep)
        victim = next(d for d in self.accepted if d not in wanted)
        sub = self._remove(victim)
        assert sub is not None
        text = "evicted to make room for the agreed input set"
        return [Reject(sub.peer_id, Reason.BUSY, text), Dropped((victim,))]

    def _maybe_close(self, now: float) -> list[Action]:
        p = self.params
        n = len(self.accepted) - self.probationary  # trusted submissions (core.trust)
        enough = n >= p.min_learners
        if enough and self.enough_at is None:
            self.enough_at = now
        # At once when every trusted learner is in and as many inputs as live learners, or as
        # many probationary ones as an input set may hold next to them (a probationary one
        # still training is waited for, by the linger at most, only while there is room: free
        # riders announced as learners would otherwise cost every round a linger, issue 44).
        room_full = self.probationary >= p.room(n)
        everyone = n >= p.trusted_live and (len(self.accepted) >= p.active_learners or room_full)
        lingered = enough and self.enough_at is not None and now >= self.enough_at + p.linger
        deadline = now >= self.close_deadline
        if self.phase is not Phase.COLLECTING or n == 0 or not (everyone or lingered or deadline):
            return []
        self.phase = Phase.AGREEING
        self.closed_at = now
        return self._propose() if self.leader(now) == self.me else []

    def _propose(self) -> list[Action]:
        """Leader: announce the input set and aggregate it ourselves. The set holds every
        trusted submission and the earliest probationary ones that fit ``RoundParams.room``."""
        p = self.params
        trusted = [d for d, s in self.accepted.items() if p.is_trusted(s.peer_id)]
        others = [d for d, s in self.accepted.items() if not p.is_trusted(s.peer_id)]
        if credits := p.progress:  # closest to trust first: trust, and the room, grow fastest
            others.sort(key=lambda d: -credits.get(self.accepted[d].peer_id, 0))
        digests = tuple(sorted(trusted + others[: p.room(len(trusted))]))
        self.input_set = digests
        return [Propose(digests, self.attempt), self._aggregate()]

    def _adopted(self, leader: str) -> list[Action]:
        """Every submission of the leader's set is here: aggregate it, unless it holds more
        probationary submissions than ``RoundParams.room`` allows (a faulty leader: the set is
        refused, and with no set adopted ``leader_silent`` hands the version on)."""
        assert self.input_set is not None
        p = self.params
        t = sum(p.is_trusted(self.accepted[d].peer_id) for d in self.input_set)
        over, room = len(self.input_set) - t, p.room(t)
        if p.trusted is not None and p.locked is None and over > room:
            self.input_set = None
            text = f"input set holds {over} probationary inputs next to {t} trusted (room {room})"
            return [Reject(leader, Reason.OVER_PROBATION, text)]
        return [self._aggregate()]

    def _aggregate(self) -> Aggregate:
        assert self.input_set is not None
        self.phase = Phase.AGGREGATING
        p, digests = self.params, self.input_set
        anchors = tuple(p.is_trusted(self.accepted[d].peer_id) for d in digests)
        return Aggregate(
            digests, self.weights(digests), self.attempt, () if all(anchors) else anchors
        )
