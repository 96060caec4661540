"""The sans-IO syncer round, driven in memory exactly as the node and the simulator drive it."""

from __future__ import annotations

import hashlib

import pytest

from p2pdiloco.core.round import (
    Aggregate,
    Done,
    Dropped,
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
    SyncerRound,
)
from p2pdiloco.protocol.reasons import RETRYABLE, Reason

RUN = "run"
COMMITTEE = ("s0", "s1", "s2", "s3")


def params(**kw) -> RoundParams:
    base = dict(
        run_id=RUN,
        version=10,
        committee=COMMITTEE,
        quorum=3,
        active_learners=5,
        opened_at=0.0,
        grace=60.0,
        staleness=2,
        max_tokens_per_step=1000,
        weight_cap=0.5,
    )
    base.update(kw)
    return RoundParams(**base)  # type: ignore[arg-type]


def sub(i: int, base: int = 10, steps: int = 10, tokens: int = 5000, run: str = RUN) -> Submission:
    return Submission(f"learner{i}", run, base, steps, tokens, f"d{i:02d}")


def honest_hash(agg: Aggregate) -> str:
    return hashlib.sha256(repr((agg.digests, agg.weights)).encode()).hexdigest()


def only_reject(actions: list) -> Reject:
    assert len(actions) == 1 and isinstance(actions[0], Reject)
    return actions[0]


class Committee:
    """Routes actions between syncers in memory; ``byzantine`` syncers sign garbage; a syncer
    in ``fail`` cannot merge the set of that (syncer, attempt) and reports ``on_merge_failed``."""

    def __init__(
        self,
        p: RoundParams,
        byzantine: frozenset[str] = frozenset(),
        down: frozenset[str] = frozenset(),
        fail: frozenset[tuple[str, int]] = frozenset(),
    ):
        self.rounds = {s: SyncerRound(p, s) for s in p.committee if s not in down}
        self.byzantine = byzantine
        self.fail = fail
        self.done: dict[str, Done] = {}
        self.log: list[tuple[str, object]] = []

    def actions(self, kind: type) -> list[tuple[str, object]]:
        return [(who, a) for who, a in self.log if isinstance(a, kind)]

    def run(self, syncer: str, actions: list, now: float) -> None:
        queue = [(syncer, a) for a in actions]
        while queue:
            who, action = queue.pop(0)
            self.log.append((who, action))
            if isinstance(action, Propose):
                for other, r in self.rounds.items():
                    if other != who:
                        got = r.on_proposal(who, action.digests, now, action.attempt)
                        queue += [(other, a) for a in got]
            elif isinstance(action, Fetch):
                donor, r = self.rounds[action.from_peer], self.rounds[who]
                for d in action.digests:
                    if d not in donor.accepted:  # the donor dropped it: the driver gives up
                        queue += [(who, a) for a in r.on_merge_failed(now)]
                        break
                    queue += [(who, a) for a in r.on_fetched(donor.accepted[d])]
            elif isinstance(action, Aggregate):
                r = self.rounds[who]
                if (who, action.attempt) in self.fail:
                    queue += [(who, a) for a in r.on_merge_failed(now, action.attempt)]
                else:
                    h = "evil" if who in self.byzantine else honest_hash(action)
                    queue += [(who, a) for a in r.on_aggregated(h, action.attempt)]
            elif isinstance(action, Sign):
                for other, r in self.rounds.items():
                    if other != who:
                        queue += [(other, a) for a in r.on_signature(who, action.state_hash)]
            elif isinstance(action, Done):
                self.done[who] = action

    def submit(self, s: Submission, now: float, to: tuple[str, ...] | None = None) -> list:
        out = []
        for name in to or tuple(self.rounds):
            actions = self.rounds[name].on_submission(s, now)
            out += actions
            self.run(name, actions, now)
        return out

    def tick(self, now: float) -> None:
        for name, r in self.rounds.items():
            self.run(name, r.on_tick(now), now)


def test_honest_round_closes_at_quorum_of_learners_and_is_certified_by_all() -> None:
    p = params()
    c = Committee(p)
    for i in range(3):  # ceil(0.6 × 5) = 3 learners close the round
        c.submit(sub(i), now=1.0 + i)
    assert set(c.done) == set(COMMITTEE)
    hashes = {d.state_hash for d in c.done.values()}
    assert len(hashes) == 1 and all(
        d.version == 11 and d.agreed_with_quorum for d in c.done.values()
    )
    assert len(next(iter(c.done.values())).signers) >= 3


def test_round_closes_at_grace_with_fewer_learners() -> None:
    c = Committee(params())
    c.submit(sub(0), now=1.0)
    c.tick(30.0)
    assert not c.done
    c.tick(61.0)
    assert set(c.done) == set(COMMITTEE)


def test_an_adaptive_close_shortens_the_grace_and_never_lengthens_it() -> None:
    c = Committee(params(close_after=5.0))  # the adaptive grace (sync.arrivals) said 5 s
    c.submit(sub(0), now=1.0)
    c.tick(4.9)
    assert not c.done
    c.tick(5.1)
    assert set(c.done) == set(COMMITTEE)
    late = Committee(params(close_after=600.0))  # never past the manifest's grace
    late.submit(sub(0), now=1.0)
    late.tick(61.0)
    assert set(late.done) == set(COMMITTEE)


def test_screening_rejects_and_fast_forwards() -> None:
    c = Committee(params())
    r = c.rounds["s1"]
    assert r.on_submission(sub(1, base=7), 1.0) == [
        Reject("learner1", Reason.STALE, "stale: base version 7 is older than 8"),
        FastForward("learner1", 10),
    ]

    too_new = only_reject(r.on_submission(sub(2, base=11), 1.0))
    assert too_new.code is Reason.BASE_TOO_NEW and "newer than the certified" in too_new.reason
    wrong_run = only_reject(r.on_submission(sub(3, run="other"), 1.0))
    assert wrong_run.code is Reason.WRONG_RUN and "another run" in wrong_run.reason
    claim = only_reject(r.on_submission(sub(4, steps=2, tokens=2001), 1.0))
    assert claim.code is Reason.BAD_CLAIM and "exceeds steps × batch × seq_len" in claim.reason
    assert only_reject(r.on_submission(sub(6, steps=0), 1.0)).code is Reason.BAD_CLAIM
    assert r.on_submission(sub(5), 1.0) == []
    dup = only_reject(r.on_submission(sub(5), 1.0))
    assert dup.code is Reason.DUPLICATE and "duplicate" in dup.reason
    again = Submission("learner5", RUN, 10, 10, 5000, "other-digest")
    second = only_reject(r.on_submission(again, 1.0))
    assert second.code is Reason.DUPLICATE and "same learner" in second.reason
    r.on_submission(sub(7), 1.0)
    r.on_submission(sub(8), 1.0)  # the third accepted learner closes the round
    assert r.phase is not Phase.COLLECTING
    closed = only_reject(r.on_submission(sub(9), 2.0))
    assert closed.code is Reason.ROUND_CLOSED and "already closed" in closed.reason


def test_stale_but_allowed_deltas_are_down_weighted_and_weights_capped() -> None:
    r = SyncerRound(params(weight_cap=1.0), "s0")
    for s in (sub(0, base=10), sub(1, base=9), sub(2, base=8)):
        r.on_submission(s, 1.0)
    assert r.weights(("d00", "d01", "d02")) == (5000.0, 2500.0, 5000 / 3)
    capped = SyncerRound(params(weight_cap=0.4), "s0")
    capped.on_submission(sub(0, tokens=9000), 1.0)
    capped.on_submission(sub(1, tokens=1000), 1.0)
    capped.on_submission(sub(2, tokens=1000), 1.0)
    w = capped.weights(("d00", "d01", "d02"))
    assert w[0] / sum(w) == pytest.approx(0.4, abs=1e-6)


def test_followers_fetch_what_they_missed_and_agree_on_the_leaders_set() -> None:
    c = Committee(params())
    c.submit(sub(0), 1.0)
    c.submit(sub(1), 1.0, to=("s0", "s1"))  # s2, s3 never saw learner1 directly
    c.submit(sub(2), 1.0, to=("s0", "s2", "s3"))
    assert any(isinstance(a, Fetch) for _, a in c.log)
    assert {d.state_hash for d in c.done.values()} == {next(iter(c.done.values())).state_hash}
    assert len(c.done) == 4


def test_a_byzantine_syncer_cannot_block_or_change_the_certificate() -> None:
    c = Committee(params(), byzantine=frozenset({"s3"}))
    for i in range(3):
        c.submit(sub(i), 1.0)
    digests = ("d00", "d01", "d02")
    expected = honest_hash(Aggregate(digests, c.rounds["s0"].weights(digests), 0))
    assert {d.state_hash for d in c.done.values()} == {expected}
    assert "s3" not in next(iter(c.done.values())).signers
    assert c.done["s3"].agreed_with_quorum is False  # it learns it was the odd one out


def test_too_few_honest_syncers_certify_nothing() -> None:
    c = Committee(params(), byzantine=frozenset({"s2", "s3"}))
    for i in range(3):
        c.submit(sub(i), 1.0)
    assert not c.done  # 2 honest signatures < quorum 3; 2 garbage ones do not match


def test_proposals_and_signatures_from_the_wrong_syncers_are_refused() -> None:
    r = SyncerRound(params(), "s1")
    r.on_submission(sub(0), 1.0)
    not_leader = only_reject(r.on_proposal("s2", ("d00",), 1.0))
    assert not_leader.code is Reason.NOT_LEADER and "not the current leader" in not_leader.reason
    unsorted = only_reject(r.on_proposal("s0", ("d01", "d00"), 1.0))
    assert unsorted.code is Reason.MALFORMED and "malformed" in unsorted.reason
    assert only_reject(r.on_proposal("s0", (), 1.0)).code is Reason.MALFORMED
    outsider = only_reject(r.on_signature("mallory", "h"))
    assert outsider.code is Reason.OUTSIDE_COMMITTEE and "outside the committee" in outsider.reason
    r.on_signature("s2", "h1")
    twice = only_reject(r.on_signature("s2", "h2"))
    assert twice.code is Reason.EQUIVOCATION and "equivocation" in twice.reason
    with pytest.raises(ValueError):
        SyncerRound(params(), "outsider")


def assert_every_reject_has_a_code(c: Committee) -> None:
    for _, a in c.actions(Reject):
        assert isinstance(a, Reject) and isinstance(a.code, Reason) and a.reason


def test_fetched_submission_outside_the_set_is_refused() -> None:
    r = SyncerRound(params(), "s1")
    r.on_submission(sub(0), 1.0)
    assert r.on_proposal("s0", ("d00", "d01"), 1.0) == [Fetch(("d01",), "s0")]
    outside = r.on_fetched(sub(2))
    assert [a.code for a in outside if isinstance(a, Reject)] == [Reason.NOT_IN_INPUT_SET]
    assert r.on_fetched(sub(1)) == [Aggregate(("d00", "d01"), r.weights(("d00", "d01")), 0)]


def test_a_merge_failing_on_one_syncer_leaves_it_out_but_it_learns_the_certificate() -> None:
    c = Committee(params(), fail=frozenset({("s2", 0)}))
    for i in range(3):
        c.submit(sub(i), 1.0)
    assert set(c.done) == set(COMMITTEE)
    certified = c.done["s0"]
    assert certified.signers == ("s0", "s1", "s3")
    assert all(d == certified for s, d in c.done.items() if s != "s2")
    assert certified.agreed_with_quorum
    assert c.done["s2"] == Done(11, certified.state_hash, certified.signers, False)
    assert not [who for who, _ in c.actions(Sign) if who == "s2"]  # signed nothing for the set
    failed = c.rounds["s2"]
    assert failed.attempt == 1 and failed.own_hash is None
    assert c.actions(Dropped) == [("s2", Dropped(("d00", "d01", "d02")))]
    rejects = [a for who, a in c.actions(Reject) if who == "s2" and isinstance(a, Reject)]
    assert {(a.peer_id, a.code) for a in rejects} == {
        (f"learner{i}", Reason.MERGE_FAILED) for i in range(3)
    }
    assert_every_reject_has_a_code(c)


def test_a_merge_failing_everywhere_opens_attempt_1_under_the_next_leader() -> None:
    p = params(grace=60.0)
    c = Committee(p, fail=frozenset((s, 0) for s in COMMITTEE))
    for i in range(3):
        c.submit(sub(i), 30.0)  # attempt 0 closes and fails at t=30: attempt 1 opens then
    assert not c.done and not c.actions(Sign)
    for r in c.rounds.values():
        assert (r.attempt, r.phase, r.accepted) == (1, Phase.COLLECTING, {})
        assert r.status_of("d01") == SubmissionStatus(Standing.DROPPED, Reason.MERGE_FAILED)
        assert r.leader(35.0) == "s1"
    resent = c.submit(sub(0), 35.0, to=("s0",))  # the dropped delta is refused if sent again
    assert [(a.peer_id, a.code) for a in resent] == [("learner0", Reason.MERGE_FAILED)]
    c.submit(sub(3), 35.0)
    c.tick(61.0)  # past the round's grace (0 + 60), not the attempt's (30 + 60)
    assert not c.done and all(r.phase is Phase.COLLECTING for r in c.rounds.values())
    c.submit(sub(4), 62.0)
    c.tick(90.5)
    assert set(c.done) == set(COMMITTEE)
    proposals = c.actions(Propose)
    assert proposals[0] == ("s0", Propose(("d00", "d01", "d02"), 0))
    assert proposals[-1] == ("s1", Propose(("d03", "d04"), 1))
    assert {d.state_hash for d in c.done.values()} == {
        honest_hash(Aggregate(("d03", "d04"), c.rounds["s1"].weights(("d03", "d04")), 1))
    }
    assert all(d.agreed_with_quorum for d in c.done.values())
    assert_every_reject_has_a_code(c)


def test_a_proposal_for_another_attempt_is_refused_and_retryable() -> None:
    r = SyncerRound(params(), "s1")
    for i in range(3):
        r.on_submission(sub(i), 1.0)
    r.on_proposal("s0", ("d00", "d01", "d02"), 1.0, attempt=0)
    r.on_merge_failed(1.5, attempt=0)
    assert r.attempt == 1
    r.on_submission(sub(5), 2.0)
    for attempt in (0, 2):
        refused = r.on_proposal("s1", ("d05",), 2.0, attempt=attempt)
        assert [a.code for a in refused if isinstance(a, Reject)] == [Reason.NO_OPEN_ROUND]
        assert Reason.NO_OPEN_ROUND in RETRYABLE
    assert r.input_set is None and r.phase is Phase.COLLECTING  # not adopted
    # The current attempt's leader (s1, member 1) is followed.
    assert r.on_proposal("s1", ("d05",), 2.0, attempt=1)[0] == Aggregate(
        ("d05",), r.weights(("d05",)), 1
    )
    follower = SyncerRound(params(), "s2")  # still in attempt 0: refuses attempt 1
    stale = only_reject(follower.on_proposal("s1", ("d05",), 2.0, attempt=1))
    assert stale.code is Reason.NO_OPEN_ROUND


def test_a_syncer_that_signed_never_signs_another_state_for_the_version() -> None:
    r = SyncerRound(params(quorum=3), "s0")
    for i in range(3):
        r.on_submission(sub(i), 1.0)
    assert r.phase is Phase.AGGREGATING
    assert r.on_aggregated("h1", attempt=0)[0] == Sign(11, "h1")
    out = r.on_merge_failed(2.0, attempt=0, screened_out={"d01"})  # the driver abandons h1
    codes = {a.peer_id: a.code for a in out if isinstance(a, Reject)}
    assert codes == {
        "learner0": Reason.MERGE_FAILED,
        "learner1": Reason.SCREENED_OUT,
        "learner2": Reason.MERGE_FAILED,
    }
    assert r.status_of("d01") == SubmissionStatus(Standing.DROPPED, Reason.SCREENED_OUT)
    for i in (3, 4, 5):
        r.on_submission(sub(i), 3.0)
    assert r.phase is Phase.AGREEING and r.attempt == 1 and r.leader(3.0) == "s1"
    r.on_proposal("s1", ("d03", "d04", "d05"), 3.0, attempt=1)
    assert r.phase is Phase.AGGREGATING
    assert r.on_aggregated("h2", attempt=1) == []  # no second signature for version 11
    assert r.own_hash == "h1" and r.signatures == {"s0": "h1"}
    r.on_signature("s1", "h1")
    done = r.on_signature("s2", "h1")
    assert done == [Done(11, "h1", ("s0", "s1", "s2"), False)]  # h1 was abandoned here


def test_late_answers_for_an_old_attempt_are_ignored() -> None:
    r = SyncerRound(params(), "s0")
    for i in range(3):
        r.on_submission(sub(i), 1.0)
    r.on_merge_failed(2.0, attempt=0)
    for i in (3, 4, 5):
        r.on_submission(sub(i), 3.0)
    assert r.phase is Phase.AGREEING and r.leader(3.0) == "s1"  # s1 leads attempt 1
    assert r.on_merge_failed(4.0, attempt=0) == [] and r.on_aggregated("h", attempt=0) == []
    assert r.on_proposal("s1", ("d03", "d04", "d05"), 4.0, attempt=1)[0] == Aggregate(
        ("d03", "d04", "d05"), r.weights(("d03", "d04", "d05")), 1
    )
    assert r.on_merge_failed(5.0, attempt=0) == [] and r.on_aggregated("h", attempt=0) == []
    assert r.on_aggregated("h", attempt=1)[0] == Sign(11, "h")


def test_a_proposal_naming_a_dropped_submission_is_refused() -> None:
    r = SyncerRound(params(), "s1")
    for i in range(3):
        r.on_submission(sub(i), 1.0)
    r.on_proposal("s0", ("d00", "d01", "d02"), 1.0)
    r.on_merge_failed(2.0)
    r.on_submission(sub(3), 3.0)
    refused = r.on_proposal("s1", ("d00", "d03"), 3.0, attempt=1)
    assert [a.code for a in refused if isinstance(a, Reject)] == [Reason.MERGE_FAILED]
    assert r.input_set is None


def test_status_of_tells_pending_dropped_and_unknown() -> None:
    r = SyncerRound(params(), "s0")
    r.on_submission(sub(0), 1.0)
    assert r.status_of("d00") == SubmissionStatus(Standing.PENDING)
    assert r.status_of("nope") == SubmissionStatus(Standing.UNKNOWN)


def test_a_full_round_refuses_with_busy_and_evicts_for_the_agreed_set() -> None:
    p = params(max_inputs=3, active_learners=100, min_fraction=1.0, linger=10.0)
    r = SyncerRound(p, "s1")
    for i in range(3):
        assert r.on_submission(sub(i), 1.0) == []
    busy = r.on_submission(sub(3), 1.0)
    assert [(a.code, a.peer_id) for a in busy if isinstance(a, Reject)] == [
        (Reason.BUSY, "learner3")
    ]
    assert Reason.BUSY in RETRYABLE and len(r.accepted) == 3
    r.on_tick(11.0)  # lingered: closes with the 3 it holds
    assert r.phase is Phase.AGREEING
    r.on_proposal("s0", ("d00", "d07"), 11.0)
    out = r.on_fetched(sub(7))
    assert out[:2] == [
        Reject("learner1", Reason.BUSY, "evicted to make room for the agreed input set"),
        Dropped(("d01",)),
    ]
    assert isinstance(out[2], Aggregate) and out[2].digests == ("d00", "d07")
    assert len(r.accepted) == 3 and "d01" not in r.accepted
    too_long = r.on_proposal("s0", ("a", "b", "c", "d"), 11.0)
    assert r.phase is Phase.AGGREGATING and too_long == []  # already adopted a set
    fresh = SyncerRound(p, "s1")
    assert fresh.on_proposal("s0", ("a", "b", "c", "d"), 1.0)[0].code is Reason.MALFORMED


def test_a_proposal_of_the_full_input_bound_opens() -> None:
    """The proposal envelope limit fits MAX_PROPOSAL_DIGESTS digests (the round's max_inputs)."""
    from p2pdiloco.protocol.identity import Identity
    from p2pdiloco.sync.committee_msgs import (
        MAX_PROPOSAL_DIGESTS,
        open_proposal,
        seal_proposal,
    )

    leader = Identity.generate()
    digests = tuple(sorted(f"{i:064x}" for i in range(MAX_PROPOSAL_DIGESTS)))
    raw = seal_proposal(leader, "ab" * 32, 7, 0, digests)
    prop = open_proposal(raw, "ab" * 32)
    assert prop.digests == digests and prop.signer == leader.peer_id
