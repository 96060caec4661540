"""View change: timeout votes, timeout certificates, the committee of each view, and the chain
rule that two certificates for one version are never both valid."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from p2pdiloco.core.roster import committee_for, next_roster, roster_of, verify_successor
from p2pdiloco.core.views import ViewState
from p2pdiloco.protocol.certificates import (
    Certificate,
    CertificateBody,
    assemble,
    content_digest,
    parse_certificate,
    roster_digest,
    sign_body,
)
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.protocol.view_change import (
    MAX_VIEW,
    TimeoutCert,
    parse_timeout_cert,
    sign_vote,
    timeout_lock,
)
from tests.test_roster import BY_PEER, IDS, PEERS, RUN, manifest, receipt, successor

H1, H2 = "11" * 32, "22" * 32


def tc_of(view: int, version: int, votes: dict[str, str | None]) -> TimeoutCert:
    signed = [sign_vote(BY_PEER[p], RUN, version, view, h) for p, h in sorted(votes.items())]
    return TimeoutCert(view, tuple(signed))


# ---------------------------------------------------------------------------------------------
# the timeout bound


@pytest.mark.parametrize(
    ("k", "q", "votes", "expected"),
    [
        (4, 3, [None, None], (True, None)),  # two silent: at most 2 < 3 could sign: free
        (4, 3, [None], (False, None)),  # three silent members could still certify anything
        (4, 3, [H1, H1], (True, H1)),  # two dead + two that signed H1: H1 may be certified
        (4, 3, [H1, H1, None], (True, H1)),  # 1 silent + 2 signed H1 = 3: locked on H1
        (4, 3, [H1, H2, None], (True, None)),  # 1 silent + 1 = 2 < 3: free
        (4, 3, [H1, H2], (False, None)),  # 2 silent + 1 = 3 for both H1 and H2: undecided
        (3, 3, [H1, H1, H2], (True, None)),  # the split that stalled a run: nobody reached 3
        (3, 3, [H1, H1], (True, H1)),  # the third may have signed H1
        (1, 1, [None], (True, None)),
        (3, 3, [None], (False, None)),  # a lone vote never ends a view (issue 44)
        (3, 3, [H1], (False, None)),
        (3, 2, [None, None], (True, None)),  # a short committee's quorum of 2: one gone
        (3, 2, [None], (False, None)),
        (2, 2, [None], (False, None)),
        (7, 5, [None, None], (False, None)),  # f + 1 = 3 voters at least
        (7, 5, [None, None, None], (True, None)),
    ],
)
def test_timeout_lock_counts_silent_members_as_possible_signers(
    k: int, q: int, votes: list[str | None], expected: tuple[bool, str | None]
) -> None:
    members = PEERS[:k]
    tc = tc_of(0, 9, dict(zip(members, votes, strict=False)))
    assert timeout_lock(tc, members, q) == expected


@pytest.mark.parametrize(("k", "q"), [(3, 3), (4, 3), (5, 4), (7, 5)])
def test_a_certified_view_only_ever_yields_timeout_certificates_locked_on_it(
    k: int, q: int
) -> None:
    """Exhaustive over who signed H1 (a quorum: the view certified) and which members vote
    (honestly reporting what they signed): every set of votes that is a timeout certificate
    locks H1, so the next view can only certify H1 again."""
    members = PEERS[:k]
    for signers in itertools.chain.from_iterable(
        itertools.combinations(members, n) for n in range(q, k + 1)
    ):
        for n in range(1, k + 1):
            for voters in itertools.combinations(members, n):
                votes = {v: (H1 if v in signers else None) for v in voters}
                ok, lock = timeout_lock(tc_of(0, 9, votes), members, q)
                assert not ok or lock == H1, (signers, voters)


def test_votes_of_non_members_do_not_count() -> None:
    members = PEERS[:4]
    outsiders = {p: None for p in PEERS[6:10]}
    assert timeout_lock(tc_of(0, 9, outsiders), members, 3) == (False, None)


def test_a_tampered_vote_is_refused_in_one_line() -> None:
    tc = tc_of(0, 9, {PEERS[0]: None})
    wire = tc.wire()
    wire["votes"][PEERS[0]]["signed"] = H1  # claims it signed something it did not sign
    with pytest.raises(InvalidRecord, match="does not verify"):
        parse_timeout_cert(RUN, 9, wire)
    assert parse_timeout_cert(RUN, 9, tc.wire()) == tc
    with pytest.raises(InvalidRecord, match="does not verify"):
        parse_timeout_cert(RUN, 10, tc.wire())  # a vote for another version


# ---------------------------------------------------------------------------------------------
# the committee of each view


def big_run() -> tuple[RunManifest, Certificate]:
    m = manifest(genesis_committee=PEERS[:4])
    return m, successor(m, None, [receipt(p, 100) for p in PEERS[:10]])


def test_each_view_slides_past_a_blocking_set_and_is_the_same_on_every_node() -> None:
    m, prev = big_run()  # 10 on the roster, k = 4, q = 3: each view replaces k − q + 1 = 2
    views = [committee_for(RUN, m, prev, j) for j in range(6)]
    assert views[1] == committee_for(RUN, m, prev, 1)  # deterministic
    assert views[1].members[:2] == views[0].members[2:]  # the window moved by 2
    assert not set(views[0].members[:2]) & set(views[1].members)
    seated = set().union(*(set(v.members) for v in views[:5]))
    assert seated == set(PEERS[:10])  # every candidate sits within a few views
    assert all(len(v.members) == 4 and v.quorum == 3 for v in views)
    assert len({v.members[0] for v in views[:5]}) == 5  # a new leader each view
    with pytest.raises(ValueError):
        committee_for(RUN, m, prev, MAX_VIEW + 1)


def test_any_two_dead_of_six_leave_a_live_quorum_within_two_views() -> None:
    m = manifest(genesis_committee=PEERS[:4])
    prev = successor(m, None, [receipt(p, 100) for p in PEERS[:6]])
    views = [committee_for(RUN, m, prev, j) for j in range(3)]
    for dead in itertools.combinations(PEERS[:6], 2):
        assert any(len(set(v.members) - set(dead)) >= v.quorum for v in views), dead


def test_a_small_roster_reuses_its_members_in_later_views_under_another_leader() -> None:
    m = manifest(genesis_committee=PEERS[:4])
    prev = successor(m, None, [receipt(p, 100) for p in PEERS[:4]])
    v0, v1 = committee_for(RUN, m, prev, 0), committee_for(RUN, m, prev, 1)
    assert set(v0.members) == set(v1.members) == set(PEERS[:4])
    assert v1.members[0] == v0.members[2]


# ---------------------------------------------------------------------------------------------
# certificates of later views, on the chain


def view_cert(
    m: RunManifest, prev: Certificate, view: int, tcs: list[TimeoutCert], **over: Any
) -> Certificate:
    info = committee_for(RUN, m, prev, view)
    accepted = [receipt(PEERS[11], 5)]
    fields: dict[str, Any] = {
        "run": RUN,
        "version": info.version,
        "base_version": info.version - 1,
        "view": view,
        "state_hash": "ef" * 32,
        "committee": list(info.members),
        "quorum": info.quorum,
        "accepted": accepted,
        "roster_hash": roster_digest(
            next_roster(roster_of(m, prev), new_version=info.version, accepted=accepted)
        ),
    }
    fields.update(over)
    body = CertificateBody(**fields)
    sigs = {p: sign_body(BY_PEER[p], body) for p in body.committee}
    return parse_certificate(assemble(body, sigs, tuple(tcs)), run_id=RUN)


def test_a_view_one_certificate_verifies_only_with_a_proof_that_view_zero_timed_out() -> None:
    m, prev = big_run()
    v0 = committee_for(RUN, m, prev, 0)
    two_silent = tc_of(0, 2, {v0.members[0]: None, v0.members[1]: None})
    verify_successor(RUN, m, prev, view_cert(m, prev, 1, [two_silent]))
    one_vote = tc_of(0, 2, {v0.members[0]: None})
    with pytest.raises(InvalidRecord, match="do not prove that it timed out"):
        verify_successor(RUN, m, prev, view_cert(m, prev, 1, [one_vote]))
    with pytest.raises(InvalidRecord, match="must carry 1 timeout certificate"):
        view_cert(m, prev, 1, [])
    # signed by view 0's committee but claiming view 1: not the committee of view 1
    with pytest.raises(InvalidRecord, match="committee or quorum"):
        verify_successor(
            RUN,
            m,
            prev,
            view_cert(m, prev, 1, [two_silent], committee=list(v0.members)),
        )


def test_two_certificates_for_one_version_never_certify_different_contents() -> None:
    """View 0 certified content C with signers a, b, c. Whatever votes its honest members give
    (each reports what it signed), a view-1 certificate verifies only if it certifies C too."""
    m, prev = big_run()
    v0 = committee_for(RUN, m, prev, 0)
    c = content_digest(view_cert(m, prev, 0, []).body)
    signers = v0.members[:3]
    other_content = {"state_hash": "99" * 32}
    for n in range(1, 5):
        for voters in itertools.combinations(v0.members, n):
            tc = tc_of(0, 2, {v: (c if v in signers else None) for v in voters})
            with pytest.raises(InvalidRecord):
                verify_successor(RUN, m, prev, view_cert(m, prev, 1, [tc], **other_content))
    # with enough votes the lock is proven: view 1 re-certifies the same content, and both
    # certificates elect the same next committee (the beacon is over the content)
    tc = tc_of(0, 2, {v: (c if v in signers else None) for v in v0.members})
    again = verify_successor(RUN, m, prev, view_cert(m, prev, 1, [tc]))
    first = verify_successor(RUN, m, prev, view_cert(m, prev, 0, []))
    assert content_digest(again.body) == content_digest(first.body) == c
    assert committee_for(RUN, m, again) == committee_for(RUN, m, first)


# ---------------------------------------------------------------------------------------------
# the view state machine


def test_view_state_votes_after_the_timeout_and_moves_on_with_the_proof() -> None:
    m, prev = big_run()
    v0 = committee_for(RUN, m, prev, 0)
    timeout = m.rules.view_timeout_s
    states = {p: ViewState(RUN, m, prev, p, opened_at=0.0) for p in PEERS[:10]}
    me = states[v0.members[0]]
    assert not me.due(timeout - 1) and me.due(timeout)
    outsider = next(s for p, s in states.items() if p not in v0.members)
    assert not outsider.due(10 * timeout)  # not on view 0: nothing to vote on
    votes = [sign_vote(BY_PEER[p], RUN, 2, 0, None) for p in v0.members[:2]]
    assert me.cast(votes[0], timeout) is False  # one silent-member vote proves nothing
    assert not me.due(timeout + 1)  # voted once in this view
    assert me.add(votes[1], timeout + 2) is True
    assert me.view == 1 and me.opened_at == timeout + 2 and me.tcs[0].view == 0
    # a node that heard none of the votes catches up from the TCs a later vote carries
    assert outsider.adopt(me.tcs, 5.0) is True and outsider.view == 1
    assert set(me.recipients(0)) >= set(v0.members[1:])


def test_view_state_ignores_votes_for_other_versions_views_and_committees() -> None:
    m, prev = big_run()
    v0 = committee_for(RUN, m, prev, 0)
    s = ViewState(RUN, m, prev, PEERS[0], opened_at=0.0)
    outsider = next(p for p in PEERS[:10] if p not in v0.members)
    for vote in (
        sign_vote(BY_PEER[v0.members[0]], RUN, 3, 0, None),  # another version
        sign_vote(BY_PEER[outsider], RUN, 2, 0, None),  # not on view 0
    ):
        assert s.add(vote, 1.0) is False
    assert s.votes == {}
    assert IDS  # the identities behind PEERS sign every vote above


def test_view_state_keeps_only_the_body_of_a_proven_lock() -> None:
    m, prev = big_run()
    v0 = committee_for(RUN, m, prev, 0)
    first = view_cert(m, prev, 0, [])
    c = content_digest(first.body)
    s = ViewState(RUN, m, prev, PEERS[0], opened_at=0.0)
    junk = view_cert(m, prev, 0, [], state_hash="77" * 32).body
    assert s.adopt([], 1.0, junk) is False and s.bodies == {}  # no lock proven: not kept
    locked = tc_of(0, 2, {p: c for p in v0.members[:2]})  # two dead, two signed c
    assert s.adopt([locked], 2.0, junk) is True and s.lock == c
    assert s.bodies == {} and s.locked_inputs() is None  # the junk body is not the lock's
    s.adopt([], 3.0, first.body)
    assert s.locked_inputs() == tuple(sorted(a.digest for a in first.body.accepted))
    assert s.holders() == sorted(v0.members[:2])
