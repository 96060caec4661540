"""The sans-IO round's liveness: what makes a member give up on its view (a silent or
unreachable leader, a quorum out of reach) and what it does with proposals passed on to it."""

from __future__ import annotations

from p2pdiloco.core.round import Fetch, Phase, SyncerRound
from tests.test_round import Committee, params, sub


def test_a_silent_leader_is_reported_and_nobody_else_proposes() -> None:
    # No rotation by time (members' clocks disagree on whose turn it is, and each would sign
    # its own set): the members report the silent leader and the driver changes the view.
    c = Committee(params(agree_timeout=10.0), down=frozenset({"s0"}))
    for i in range(3):
        c.submit(sub(i), 1.0)
    assert c.rounds["s1"].phase is Phase.AGREEING
    # The leader may close as late as its grace deadline (60 s): silent only 10 s after that.
    assert not any(c.rounds[s].leader_silent(65.0) for s in ("s1", "s2", "s3"))
    c.tick(72.0)
    assert not c.done  # nobody but s0 proposes in attempt 0
    assert all(c.rounds[s].leader_silent(72.0) for s in ("s1", "s2", "s3"))


def test_an_unreachable_leader_is_reported_without_waiting_for_its_grace() -> None:
    """A member whose relay to the leader failed to connect (``on_unreachable``, ADR 0038)
    stops waiting for the leader's grace deadline: silent ``agree_timeout`` after the later of
    its own close and the failure. Only the attempt's leader counts, and never a proposal
    that arrived."""
    c = Committee(params(agree_timeout=10.0), down=frozenset({"s0"}))
    for i in range(3):
        c.submit(sub(i), 1.0)
    r1, r2 = c.rounds["s1"], c.rounds["s2"]
    closed = r1.closed_at
    assert closed is not None and r1.phase is Phase.AGREEING
    r1.on_unreachable("s0", 2.0)
    r1.on_unreachable("s0", 30.0)  # the first failure counts
    r2.on_unreachable("s3", 2.0)  # not the leader: nothing changes
    assert not r1.leader_silent(max(closed, 2.0) + 9.0)
    assert r1.leader_silent(max(closed, 2.0) + 10.0)
    assert not r2.leader_silent(65.0) and r2.leader_silent(70.0)
    # an input set adopted: never silent, whatever the driver reports
    r3 = SyncerRound(params(agree_timeout=10.0), "s3")
    r3.on_submission(sub(0), 1.0)
    r3.on_proposal("s0", ("d00",), 1.5)
    r3.on_unreachable("s0", 2.0)
    assert r3.input_set == ("d00",) and not r3.leader_silent(100.0)


def test_a_member_without_submissions_reports_a_silent_leader_too() -> None:
    """A member no learner sent to (it sits in a later view than the learners expect) never
    closes its attempt; once the leader's grace deadline and agree_timeout are past with no
    proposal, the leader is silent for it as for the others (the runtime test saw two such
    members wait out a view timeout of 7,200 s). A proposal, or a submission, changes that."""
    p = params(agree_timeout=10.0)  # grace 60 s
    empty = SyncerRound(p, "s1")
    assert empty.phase is Phase.COLLECTING and not empty.accepted
    assert not empty.leader_silent(69.0) and empty.leader_silent(70.0)
    empty.on_unreachable("s0", 2.0)  # the leader found unreachable: no wait for its grace
    assert not empty.leader_silent(11.0) and not empty.leader_silent(69.0)  # its own deadline
    holding = SyncerRound(p, "s2")
    holding.on_submission(sub(0), 1.0)
    assert holding.phase is Phase.COLLECTING and not holding.leader_silent(59.0)
    told = SyncerRound(p, "s3")
    told.on_proposal("s0", ("d00",), 1.5)
    assert not told.leader_silent(100.0)
    itself = SyncerRound(p, "s0")  # the leader, holding nothing, proposes nothing
    assert not itself.leader_silent(100.0)  # its fellows find it silent; it does not


def test_a_quorum_out_of_reach_is_reported_without_waiting_for_the_view_timeout() -> None:
    """With more than k − q fellows unreachable (and not signed), the members left cannot
    certify: ``quorum_unreachable`` ``agree_timeout`` after the failure that made them so many
    (ADR 0041). A fellow heard from again, or whose signature is in, does not count."""
    c = Committee(params(agree_timeout=10.0), down=frozenset({"s2", "s3"}))  # k 4, q 3
    for i in range(3):
        c.submit(sub(i), 1.0)
    r0, r1 = c.rounds["s0"], c.rounds["s1"]
    assert r0.phase is Phase.SIGNING and len(r0.signatures) == 2 and not c.done
    r0.on_unreachable("s2", 5.0)
    assert not r0.quorum_unreachable(100.0)  # k − q = 1 fellow gone: the quorum is in reach
    r0.on_unreachable("s3", 7.0)
    r0.on_unreachable("s3", 8.0)  # the first failure counts
    r0.on_unreachable("s1", 7.0)  # it signed: its signature counts whatever became of it
    r0.on_unreachable("elsewhere", 7.0)  # not on the committee: ignored
    assert not r0.quorum_unreachable(16.9) and r0.quorum_unreachable(17.0)
    r0.on_reached("s3")  # it answered after all
    assert not r0.quorum_unreachable(100.0)
    # In any phase: a member still collecting with two fellows gone votes too, and a proposal
    # from the leader is word from it.
    r1b = SyncerRound(params(agree_timeout=10.0), "s1")
    r1b.on_unreachable("s0", 1.0)
    r1b.on_unreachable("s2", 2.0)
    assert r1b.quorum_unreachable(12.0)
    r1b.on_submission(sub(0), 3.0)
    r1b.on_proposal("s0", ("d00",), 4.0)
    assert not r1b.quorum_unreachable(100.0)
    assert r1.abandon() is not None and not r1.quorum_unreachable(100.0)  # voted already


def test_a_proposal_passed_on_after_the_leaders_own_changes_nothing() -> None:
    """Fellows pass an adopted proposal on (ADR 0042), so a member gets it more than once: once
    it has a set, copies are ignored; no second fetch, no second aggregate."""
    r = SyncerRound(params(), "s1")
    r.on_submission(sub(0), 1.0)
    first = r.on_proposal("s0", ("d00", "d01"), 2.0)
    assert [type(a) for a in first] == [Fetch]
    assert r.on_proposal("s0", ("d00", "d01"), 2.5) == []  # the copy: no second fetch
    r.on_fetched(sub(1))
    assert r.phase is Phase.AGGREGATING
    assert r.on_proposal("s0", ("d00", "d01"), 3.0) == []
