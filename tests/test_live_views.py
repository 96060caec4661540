"""Views that fit the live network (ADR 0055): the pacemaker, short committees, views without a
last one, a lone vote that never ends a view, and the chain rule that two certificates for
one version never both verify, however the timeout certificates are assembled. The core
machines on a fake clock (plain floats): no network, no sleeps."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from p2pdiloco.core import committee
from p2pdiloco.core.roster import committee_for, verify_successor
from p2pdiloco.core.views import (
    ViewState,
    backoff,
    catch_up,
    hear_vote,
    view_at,
    view_start,
    view_timeout,
)
from p2pdiloco.protocol.certificates import content_digest
from p2pdiloco.protocol.records import RunManifest, SyncRules, run_id_of
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.protocol.view_change import (
    Lock,
    TimeoutCert,
    min_votes,
    parse_timeout_cert,
    sign_vote,
    tc_lock,
    timeout_lock,
)
from p2pdiloco.sync.view_driver import open_vote, vote_message
from tests.test_roster import BY_PEER, PEERS, RUN, manifest, receipt, successor
from tests.test_view_change import H1, big_run, tc_of, view_cert


def tc_locked(
    view: int, version: int, votes: dict[str, tuple[str | None, Lock | None]]
) -> TimeoutCert:
    """A TC whose voters report what they signed and the lock they held."""
    signed = [
        sign_vote(BY_PEER[p], RUN, version, view, s, lock) for p, (s, lock) in sorted(votes.items())
    ]
    return TimeoutCert(view, tuple(signed))


# ---------------------------------------------------------------------------------------------
# the pacemaker


def test_view_timeouts_double_up_to_the_manifests_bound_and_the_view_is_their_inverse() -> None:
    rules = SyncRules(grace=4.0, agree_timeout=2.0, view_timeout=10.0, view_timeout_max=80.0)
    assert [view_timeout(rules, j) for j in range(6)] == [10, 20, 40, 80, 80, 80]
    assert [view_start(rules, j) for j in range(6)] == [0, 10, 30, 70, 150, 230]
    for j in range(40):  # every node computes the same view from the time since the base
        start = view_start(rules, j)
        assert (
            view_at(rules, start) == j
            and view_at(rules, start + view_timeout(rules, j) - 1e-6) == j
        )
    assert view_at(rules, 10**9) == 3 + (10**9 - 70) // 80
    default = SyncRules(grace=4.0, agree_timeout=2.0, view_timeout=10.0)
    assert default.view_timeout_max_s == 80.0 and backoff(default, 30) == 8.0
    with pytest.raises(ValueError, match="view_timeout_max"):
        SyncRules(grace=4.0, agree_timeout=2.0, view_timeout=10.0, view_timeout_max=5.0)


def test_a_certificate_starts_the_next_version_at_the_first_timeout_again() -> None:
    m, prev = big_run()
    t = m.rules.view_timeout_s
    st = ViewState(RUN, m, prev, PEERS[0], opened_at=0.0)
    assert st.expected_view(t - 1) == 0 and st.expected_view(t) == 1
    assert st.expected_view(3 * t) == 2 and st.expected_view(7 * t) == 3  # 1 + 2 + 4
    nxt = successor(m, prev, [receipt(p, 100) for p in PEERS[:10]])
    fresh = ViewState(RUN, m, nxt, PEERS[0], opened_at=7 * t)
    assert fresh.view == 0 and fresh.timeout() == t and fresh.expected_view(8 * t - 1) == 0


def test_a_view_after_failed_ones_waits_longer_and_its_leader_gets_longer_to_propose() -> None:
    from p2pdiloco.sync.rules import params_of

    m, prev = big_run()
    t = m.rules.view_timeout_s
    st = ViewState(RUN, m, prev, "", opened_at=0.0)
    for j in range(3):  # everyone in each view votes as its (doubled) timeout runs out
        info = st.committee()
        voter = info.members[0]
        assert not st.due(st.opened_at + st.timeout() - 0.5, voter=voter)
        assert st.due(st.opened_at + st.timeout(), voter=voter)
        now = st.opened_at + st.timeout()
        for p in info.members:
            st.add(sign_vote(BY_PEER[p], RUN, 2, j, None, st.lock_ref), now)
        assert st.view == j + 1 and st.started == 0.0
    assert st.opened_at == t + 2 * t + 4 * t and st.timeout() == 8 * t
    rp = params_of(RUN, m, 1, None, st.committee(), 4, 0.0)
    assert rp.agree_timeout == 8 * m.rules.agree_timeout


def test_a_manifest_made_before_the_pacemaker_keeps_its_bytes_and_run_id() -> None:
    old = manifest()
    body = old.model_dump(mode="json")
    assert "view_timeout_max" not in body["rules"]  # omitted while unset: same bytes, same id
    again = RunManifest.model_validate(json.loads(json.dumps(body)))
    assert run_id_of(again) == run_id_of(old) and again.rules.view_timeout_max is None
    capped = manifest(rules={"view_timeout_max": 1000.0})
    assert capped.model_dump(mode="json")["rules"]["view_timeout_max"] == 1000.0
    assert run_id_of(capped) != run_id_of(old)


# ---------------------------------------------------------------------------------------------
# timeout certificates


@pytest.mark.parametrize("n", range(2, 10))
def test_a_lone_vote_and_fewer_than_min_votes_are_never_a_timeout_certificate(n: int) -> None:
    members = PEERS[:n]
    for q in sorted({committee.quorum(n), committee.short_quorum(n), n}):
        need = min_votes(n, q)
        assert need >= 2 and need >= (n - 1) // 3 + 1 and need > n - q
        for k in range(1, need):
            for voters in itertools.combinations(members, k):
                for signed in (None, H1):
                    tc = tc_of(0, 9, dict.fromkeys(voters, signed))
                    assert timeout_lock(tc, members, q) == (False, None), (n, q, voters)


@pytest.mark.parametrize(("k", "q"), [(3, 2), (3, 3), (4, 3), (5, 4), (6, 4), (7, 5)])
def test_every_timeout_certificate_of_a_certified_view_locks_it(k: int, q: int) -> None:
    """Exhaustive over who signed H1 (a quorum: the view certified), which members vote, and
    what lock earlier views left each voter (none, or another content of view 0): every set
    of votes that is a TC of view 1 locks H1, with view 1."""
    members = PEERS[:k]
    earlier = Lock(0, "33" * 32)
    for n_signers in range(q, k + 1):
        signers = set(members[:n_signers])
        for n in range(1, k + 1):
            for voters in itertools.combinations(members, n):
                for held in (None, earlier):
                    votes = {v: (H1 if v in signers else None, held) for v in voters}
                    ok, lock = tc_lock(tc_locked(1, 9, votes), members, q)
                    assert not ok or lock == Lock(1, H1), (signers, voters, held)


def test_the_lock_of_the_latest_view_is_carried_by_voters_that_signed_nothing() -> None:
    members = PEERS[:4]
    c = Lock(2, H1)
    # view 5: nobody signed; the voters report the lock they hold: it is the TC's lock
    tc = tc_locked(5, 9, {p: (None, c) for p in members[:2]})
    assert tc_lock(tc, members, 3) == (True, c)
    # a voter with an older lock on another content: the highest view wins
    tc = tc_locked(5, 9, {members[0]: (None, c), members[1]: (None, Lock(1, "44" * 32))})
    assert tc_lock(tc, members, 3) == (True, c)
    # two contents at the same highest view: no earlier view certified either, the TC frees
    tc = tc_locked(5, 9, {members[0]: (None, c), members[1]: (None, Lock(2, "44" * 32))})
    assert tc_lock(tc, members, 3) == (True, None)
    # a vote may not report a lock of its own view or a later one
    wire = tc_locked(5, 9, {members[0]: (None, c)}).wire()
    wire["votes"][members[0]]["lock"] = [5, H1]
    with pytest.raises(InvalidRecord, match="reports a lock of view 5"):
        parse_timeout_cert(RUN, 9, wire)


# ---------------------------------------------------------------------------------------------
# the chain: two certificates for one version never both verify


def test_certificates_built_on_different_subsets_of_one_views_votes_certify_one_content() -> None:
    """View 0 certified C (three of its four members signed). Every valid TC of view 0, from
    any subset of its members' honest votes, locks C: a view-1 certificate of another content
    fails with each of them, and one of C verifies with each. Then view 1 fails too: its
    voters signed nothing there but report the lock they hold, and every valid TC of view 1
    still binds view 2 to C."""
    m, prev = big_run()
    v0 = committee_for(RUN, m, prev, 0)
    first = verify_successor(RUN, m, prev, view_cert(m, prev, 0, []))
    c = content_digest(first.body)
    signers = set(v0.members[:3])
    other = {"state_hash": "99" * 32}
    tcs0 = []
    for n in range(1, 5):
        for voters in itertools.combinations(v0.members, n):
            tc = tc_of(0, 2, {v: (c if v in signers else None) for v in voters})
            ok, lock = tc_lock(tc, v0.members, v0.quorum)
            if not ok:
                continue
            tcs0.append(tc)
            assert lock == Lock(0, c)
            with pytest.raises(InvalidRecord):
                verify_successor(RUN, m, prev, view_cert(m, prev, 1, [tc], **other))
            again = verify_successor(RUN, m, prev, view_cert(m, prev, 1, [tc]))
            assert content_digest(again.body) == c
    assert len({tc.votes for tc in tcs0}) >= 5  # many different proofs of one timeout
    v1 = committee_for(RUN, m, prev, 1)
    for n in range(1, 5):
        for voters in itertools.combinations(v1.members, n):
            tc = tc_locked(1, 2, {v: (None, Lock(0, c)) for v in voters})
            if not tc_lock(tc, v1.members, v1.quorum)[0]:
                continue
            with pytest.raises(InvalidRecord, match="another content"):
                verify_successor(RUN, m, prev, view_cert(m, prev, 2, [tc], **other))
            verify_successor(RUN, m, prev, view_cert(m, prev, 2, [tc]))
    # the committee of a view is the chain's and the view number's: no TC enters it
    assert committee_for(RUN, m, prev, 1) == v1


def test_the_rejected_rule_a_committee_without_the_silent_members_loses_the_lock() -> None:
    """The counterexample ADR 0055 gives for seating view j + 1 without the members silent in
    view j's TC. View 0 (a, b, c, d; q = 3) certified nothing; TC {c, d} (a, b silent) and
    TC' {a, b, c, d} both free view 1. Under that rule view 1 has two committees: K = {c, d,
    e, f} after TC, K' = {a, b, c, d} after TC'. Under K, c, d and e certify C in view 1. Under
    K', a and b (never in K: they signed nothing in view 1) vote and c, d stay silent: a
    valid, free TC of view 1, so view 2 may certify C' ≠ C, and both chains would verify.
    With one committee per view (ours) the votes of a, b do not count in view 1 unless they
    sit in it, and if they do, a TC of view 1 must count c, d as possible signers of C."""
    a, b, c_, d, e, f = PEERS[:6]
    q = 3
    k_after_tc = [c_, d, e, f]
    k_after_tc2 = [a, b, c_, d]
    certified = {c_, d, e}  # q signatures on C in view 1 under K
    assert len(certified & set(k_after_tc)) >= q
    lying_free = tc_of(1, 9, {a: None, b: None})
    assert timeout_lock(lying_free, k_after_tc2, q) == (True, None)  # the lock is lost
    # under one committee per view, the same votes are judged against the committee that
    # certified: a and b are not members, and the members' honest votes lock C
    assert timeout_lock(lying_free, k_after_tc, q) == (False, None)
    honest = tc_of(1, 9, {c_: H1, d: H1})
    assert timeout_lock(honest, k_after_tc, q) == (True, H1)


def test_an_honest_node_that_missed_views_catches_up_on_one_tc_and_keeps_the_lock() -> None:
    m, prev = big_run()
    v0 = committee_for(RUN, m, prev, 0)
    first = view_cert(m, prev, 0, [])
    c = content_digest(first.body)
    behind = ViewState(RUN, m, prev, PEERS[0], opened_at=0.0)
    ahead = ViewState(RUN, m, prev, "", opened_at=0.0)
    ahead.adopt([tc_of(0, 2, {p: c for p in v0.members[:2]})], 1.0, first.body)
    assert ahead.view == 1 and ahead.lock_ref == Lock(0, c)
    for j in range(1, 30):  # views with no last one: nobody signs, everyone times out
        for p in ahead.committee().members:
            ahead.add(sign_vote(BY_PEER[p], RUN, 2, j, None, ahead.lock_ref), float(j))
        assert ahead.view == j + 1 and ahead.lock == c
    assert len(ahead.tcs) == 1 and ahead.tcs[0].view == 29
    assert behind.adopt(list(ahead.tcs), 99.0, first.body) is True
    assert behind.view == 30 and behind.lock == c and behind.locked_inputs() is not None
    # a certificate of view 30 carries one TC: as large as one of view 1
    late = verify_successor(RUN, m, prev, view_cert(m, prev, 30, list(ahead.tcs)))
    assert content_digest(late.body) == c and len(late.views) == 1
    with pytest.raises(InvalidRecord, match="another content"):
        verify_successor(
            RUN, m, prev, view_cert(m, prev, 30, list(ahead.tcs), state_hash="98" * 32)
        )
    with pytest.raises(InvalidRecord, match="timeout certificate of view 29"):
        view_cert(m, prev, 30, [tc_of(3, 2, {p: None for p in PEERS[:4]})])
    assert len(behind.votes) <= 8 and len(behind._committees) <= 10  # bounded


@pytest.mark.parametrize("signed", [False, True], ids=["free", "locked"])
def test_a_fellow_that_missed_the_votes_of_a_view_is_caught_up_by_one_message(
    signed: bool,
) -> None:
    """The soak's stall: a member restarting while view 0's votes were sent stays in view 0
    while the others are in view 1, each refusing the other's messages. The first refusal
    makes a member of view 1 send it the TC that ended view 0 (``catch_up``), in a vote
    message the wire takes, and it enters view 1 with the same lock."""
    m, prev = big_run()
    v0 = committee_for(RUN, m, prev, 0)
    first = view_cert(m, prev, 0, [])
    c = content_digest(first.body) if signed else None
    ahead = ViewState(RUN, m, prev, v0.members[0], opened_at=0.0)
    behind = ViewState(RUN, m, prev, v0.members[3], opened_at=0.0)
    assert catch_up(ahead) is None  # view 0: nothing to catch up on
    for p in v0.members[:2]:  # two votes are a TC; ``behind`` was away and heard neither
        ahead.add(sign_vote(BY_PEER[p], RUN, 2, 0, c), 1.0, first.body if signed else None)
    assert ahead.view == 1 and behind.view == 0
    assert ahead.lock == c
    what = catch_up(ahead)
    assert what is not None and what.tc.view == 0 and what.vote in what.tc.votes
    raw = vote_message(what.vote, [what.tc], what.body, what.lock)
    msg = open_vote(raw, RUN)  # a fellow's vote carrying the TC of its own view: taken
    assert hear_vote(behind, msg.vote, msg.tcs, msg.body, msg.lock, 2.0) is True
    assert behind.view == 1 and behind.lock == ahead.lock and behind.tc == ahead.tc
    if signed:  # the lock's input set is known, so its round opens on it
        assert behind.locked_inputs() == ahead.locked_inputs() is not None
    # Heard again, or by a node already there, it changes nothing.
    assert hear_vote(behind, msg.vote, msg.tcs, msg.body, msg.lock, 3.0) is False
    assert hear_vote(ahead, msg.vote, msg.tcs, msg.body, msg.lock, 3.0) is False
    assert behind.view == ahead.view == 1


def test_votes_far_ahead_are_not_kept() -> None:
    m, prev = big_run()
    st = ViewState(RUN, m, prev, "", opened_at=0.0)
    far = committee_for(RUN, m, prev, 50).members[0]
    assert st.add(sign_vote(BY_PEER[far], RUN, 2, 50, None), 1.0) is False and st.votes == {}


# ---------------------------------------------------------------------------------------------
# committees that fit the live network


def three_volunteers() -> tuple[RunManifest, Any]:
    """Three peers on the roster of a run made with the default k = 4, q = 3."""
    m = manifest(genesis_committee=PEERS[:3])
    return m, successor(m, None, [receipt(p, 100) for p in PEERS[:3]])


def test_one_departure_of_three_costs_at_most_one_view() -> None:
    m, prev = three_volunteers()
    v0, v1 = committee_for(RUN, m, prev, 0), committee_for(RUN, m, prev, 1)
    assert len(v0.members) == 3 and v0.quorum == 2 and v1.quorum == 2
    for gone in PEERS[:3]:
        live = set(PEERS[:3]) - {gone}
        # view 0 certifies unless the departed member leads it; view 1 then has another leader
        if v0.members[0] != gone:
            assert len(live & set(v0.members)) >= v0.quorum
        else:
            assert v1.members[0] != gone and len(live & set(v1.members)) >= v1.quorum
        # and the two left can always leave view 0: two votes are a TC
        tc = tc_of(0, 2, dict.fromkeys(sorted(live)))
        assert timeout_lock(tc, v0.members, v0.quorum) == (True, None)


def test_whoever_sits_in_a_window_some_later_window_leaves_any_two_out() -> None:
    """k = 3 with q = 3 (the run of issue 44): any one member blocks a view. Over the first
    passes through a ranking of six, every pair of candidates (two free riders) is left out
    of some view's committee, where before a fixed ranking could hold one of them in every
    window; the honest members of a window with one free rider leave it without him."""
    m = manifest(committee_size=3, genesis_committee=PEERS[:3])
    prev = successor(m, None, [receipt(p, 100) for p in PEERS[:6]])
    views = [committee_for(RUN, m, prev, j) for j in range(60)]
    assert all(v.quorum == 3 and len(v.members) == 3 for v in views)
    for pair in itertools.combinations(PEERS[:6], 2):
        assert any(not set(pair) & set(v.members) for v in views), pair
    compositions = {frozenset(v.members) for v in views[1:]}
    assert len(compositions) > 6  # more than one pass's windows
    honest = [p for p in views[0].members[1:]]
    tc = tc_of(0, 2, dict.fromkeys(honest))
    assert timeout_lock(tc, views[0].members, 3) == (True, None)


def test_later_views_seat_members_with_a_delta_in_the_base_certificate_first() -> None:
    m = manifest(genesis_committee=PEERS[:4], rules={"committee_recency": 3})
    one = successor(m, None, [receipt(p, 100) for p in PEERS[:10]])
    two = successor(m, one, [receipt(p, 100) for p in PEERS[:4] + PEERS[7:10]])
    v0 = committee_for(RUN, m, two, 0)
    recent = set(PEERS[:4] + PEERS[7:10])
    seated = [
        p for j in (1, 2) for p in committee_for(RUN, m, two, j).members if p not in v0.members
    ]
    assert seated and all(p in recent for p in seated[:2])


# ---------------------------------------------------------------------------------------------
# liveness does not depend on a round fitting inside one timeout (the simulator drives the same
# ViewState)


def test_a_round_that_needs_three_timeouts_of_time_still_certifies() -> None:
    """Merges that take 25 s per input make each round need about 2.5 view timeouts (120 s):
    views 0 and 1 time out mid-merge and view 2 (four timeouts long) certifies, version after
    version. With the bound at one timeout (no back-off) every view times out mid-merge and
    the run stops after its first version, the livelock issue 39 found."""
    from dataclasses import replace

    from p2pdiloco.sim import SimConfig, simulate_run

    cfg = SimConfig(
        peers=12,
        committee_size=4,
        duration=3600.0,
        inner_steps=50,
        seed=3,
        merge_seconds_per_input=25.0,
        rules={"grace": 30.0, "agree_timeout": 10.0},
    )
    result, world = simulate_run(cfg, baseline=False)
    assert result.versions >= 4 and result.conflicts == 0 and result.wrong_certificates == 0
    slow = [c for c in world.certs[1:]]
    assert all(c.view >= 2 and c.certified_at - c.opened_at > 2 * 120.0 for c in slow)
    fixed = replace(cfg, rules={**cfg.rules, "view_timeout_max": 120.0})
    stuck, _ = simulate_run(fixed, baseline=False)
    assert stuck.versions <= 1 and stuck.view_changes > 10
