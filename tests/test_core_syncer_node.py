"""The syncer node machine alone (``core/syncer_node.py``), with the view driver's decisions
(``core/views.py``): events in, effects out, time as a number. No network, no clock, no loop.

The run is ``test_view_change.big_run``: 10 peers on the roster after version 1, committees of
k = 4 with q = 3, so each view of version 2 replaces two members."""

from __future__ import annotations

import hashlib

from p2pdiloco.core.roster import CommitteeInfo, committee_for
from p2pdiloco.core.round import Dropped, Phase, RoundParams, Submission
from p2pdiloco.core.syncer_node import (
    EARLY_VERSIONS,
    MAX_BUFFERED,
    FetchLocked,
    Seating,
    SyncerNode,
)
from p2pdiloco.core.views import hear_vote, leave_view
from p2pdiloco.protocol.certificates import content_digest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.view_change import sign_vote
from p2pdiloco.sync.rules import params_of
from tests.test_roster import BY_PEER, PEERS, RUN
from tests.test_view_change import big_run, view_cert

M, PREV = big_run()
VERSION = PREV.body.version  # the certified base; the rounds certify VERSION + 1
V0, V1, V2 = (committee_for(RUN, M, PREV, j) for j in range(3))
TIMEOUT = M.rules.view_timeout_s


def params_for(
    committee: CommitteeInfo, locked: tuple[str, ...] | None, close_after: float
) -> RoundParams:
    return params_of(RUN, M, VERSION, None, committee, 8, 0.0, locked, close_after)


def node_of(peer: str, m: RunManifest = M) -> SyncerNode[str, str]:
    node: SyncerNode[str, str] = SyncerNode(peer, RUN, m)
    assert node.install(PREV, VERSION, 0.0) == []
    return node


def learner(i: int) -> str:
    return Identity.from_seed(hashlib.sha256(b"learner%d" % i).digest()).peer_id


def sub(i: int, base: int = VERSION, steps: int = 20) -> Submission:
    digest = hashlib.sha256(b"sub%d" % i).hexdigest()
    return Submission(learner(i), RUN, base, steps, steps * 64, digest)


def move_to_next_view(
    node: SyncerNode[str, str], signed: dict[str, str | None], now: float
) -> bool:
    """Votes of the current view's members (member → content it signed) reach ``node``."""
    st = node.views
    assert st is not None
    moved = False
    for voter, content in signed.items():
        vote = sign_vote(BY_PEER[voter], RUN, st.version, st.view, content)
        moved = hear_vote(st, vote, [], None, None, now) or moved
    return moved


def test_a_member_holds_what_its_round_accepts_and_answers_a_resend_as_before() -> None:
    node = node_of(V0.members[0])
    opening = node.open_view(params_for, 0.0)
    assert opening.seating is Seating.MEMBER and node.round is not None
    s = sub(1)
    verdict, actions = node.on_submission(s, "payload-1", 1.0, pass_on=True)
    assert verdict.accepted and verdict.relay and not verdict.clipped and actions == []
    assert node.held[s.digest].data == "payload-1" and s.digest in node.round.accepted
    again, more = node.on_submission(s, "payload-1", 2.0, pass_on=True)
    assert again.accepted and not again.relay and more == []  # held once, not relayed twice
    assert node.resent(s.digest) == again
    assert node.seen.add(s.digest, s.base_version) is False  # judged: a later copy is a replay


def test_a_retryable_refusal_is_neither_held_nor_seen() -> None:
    node = node_of(V0.members[0])
    node.open_view(params_for, 0.0)
    s = sub(2)
    verdict, actions = node.on_submission(s, "p", 1.0, pass_on=True, busy=lambda rnd: "queued")
    assert (verdict.accepted, verdict.code, verdict.reason) == (False, Reason.BUSY, "queued")
    assert actions == [] and s.digest not in node.held
    assert node.seen.add(s.digest, s.base_version) is True  # not seen: the retry is no replay
    # the uplink is judged only for a learner's own delta it would pass on
    node2 = node_of(V0.members[0])
    node2.open_view(params_for, 0.0)
    verdict, _ = node2.on_submission(s, "p", 1.0, busy=lambda rnd: "queued")
    assert verdict.accepted and not verdict.relay


def test_a_stale_submission_is_refused_with_a_fast_forward_hint_told_once() -> None:
    m = M.model_copy(update={"rules": M.rules.model_copy(update={"staleness": 0})})
    node = node_of(V0.members[0], m)
    node.open_view(lambda c, lk, ca: params_of(RUN, m, VERSION, None, c, 8, 0.0, lk, ca), 0.0)
    verdict, _ = node.on_submission(sub(3, base=VERSION - 1), "p", 1.0)
    assert (verdict.accepted, verdict.code) == (False, Reason.STALE)
    assert verdict.fast_forward == VERSION and node.fast_forward == {}  # the certified one


def test_off_the_committee_it_opens_nothing_and_says_whether_to_retry() -> None:
    outsider = next(p for p in PEERS[:10] if p not in V0.members and p not in V1.members)
    node = node_of(outsider)
    assert node.open_view(params_for, 0.0).seating is Seating.OFF and node.round is None
    verdict, _ = node.on_submission(sub(4, base=VERSION - 1), "p", 1.0)
    soon = node.views is not None and node.views.member_soon()
    assert verdict.code is (Reason.NO_OPEN_ROUND if soon else Reason.NOT_ON_COMMITTEE)
    assert verdict.fast_forward == VERSION  # its base is older than the certified version
    next_view = next(p for p in V1.members if p not in V0.members)
    verdict, _ = node_of(next_view).on_submission(sub(4), "p", 1.0)
    assert verdict.code is Reason.NO_OPEN_ROUND and verdict.fast_forward is None  # retry later


def test_a_new_view_carries_what_the_views_before_gathered() -> None:
    both = next(p for p in V0.members if p in V1.members)
    node = node_of(both)
    node.open_view(params_for, 0.0)
    subs = [sub(i) for i in range(5, 8)]
    for s in subs:
        assert node.on_submission(s, f"p{s.digest[:4]}", 1.0)[0].accepted
    first = node.round
    assert move_to_next_view(node, {p: None for p in V0.members[:2]}, 2.0)  # 2 silent of 4
    assert node.view == 1
    opening = node.open_view(params_for, 2.0)
    assert opening.seating is Seating.MEMBER and node.round is not first
    assert [s for s, _ in opening.carried] == subs and opening.fetch is None
    assert node.round is not None and list(node.round.accepted) == [s.digest for s in subs]
    assert list(node.held) == [s.digest for s in subs]  # same order, same data
    assert node.held[subs[0].digest].data == f"p{subs[0].digest[:4]}"


def test_held_submissions_outlive_the_views_the_node_sits_out() -> None:
    node = node_of(V0.members[0])  # views slide by k − q + 1 = 2: back on view 4's committee
    node.open_view(params_for, 0.0)
    s = sub(9)
    assert node.on_submission(s, "p", 1.0)[0].accepted
    for j in range(1, 4):
        silent = committee_for(RUN, M, PREV, j - 1).members[:2]
        assert move_to_next_view(node, dict.fromkeys(silent), float(j))
        assert node.open_view(params_for, float(j)).seating is Seating.OFF and node.round is None
        assert s.digest in node.held  # still served to fellows that fetch it
        assert node.on_submission(s, "p", float(j))[0].accepted  # a resend: accepted as before
    assert move_to_next_view(node, dict.fromkeys(committee_for(RUN, M, PREV, 3).members[:2]), 4.0)
    opening = node.open_view(params_for, 4.0)
    assert node.view == 4 and opening.seating is Seating.MEMBER
    assert [c for c, _ in opening.carried] == [s] and node.round is not None
    assert s.digest in node.round.accepted


def test_a_locked_view_takes_only_the_locked_inputs_and_fetches_the_rest_from_its_signers() -> None:
    both = next(p for p in V0.members if p in V1.members)
    node = node_of(both)
    node.open_view(params_for, 0.0)
    kept, left_out, missing = sub(10), sub(11), sub(12)
    for s in (kept, left_out):
        assert node.on_submission(s, "p", 1.0)[0].accepted
    body = view_cert(
        M,
        PREV,
        0,
        [],
        accepted=[
            {"peer_id": s.peer_id, "digest": s.digest, "steps": s.steps, "tokens": s.tokens}
            for s in sorted((kept, missing), key=lambda s: s.digest)
        ],
    ).body
    content = content_digest(body)
    signers = [p for p in V0.members if p != both][:2]  # two signed it, two are silent
    st = node.views
    assert st is not None
    tc_votes = [sign_vote(BY_PEER[p], RUN, st.version, 0, content) for p in signers]
    assert hear_vote(st, tc_votes[0], [], body, None, 2.0) is False
    assert hear_vote(st, tc_votes[1], [], body, None, 2.0) is True
    assert st.lock == content and node.view == 1
    opening = node.open_view(params_for, 2.0)
    assert opening.seating is Seating.MEMBER and node.round is not None
    assert node.round.params.locked == tuple(sorted((kept.digest, missing.digest)))
    assert [s for s, _ in opening.carried] == [kept]  # the other one is outside the lock
    assert left_out.digest not in node.held
    assert opening.fetch == FetchLocked((missing.digest,), tuple(sorted(signers)))
    node.on_fetched(missing, "fetched")
    assert node.round.phase is Phase.AGGREGATING and set(node.held) == {kept.digest, missing.digest}


def test_a_lock_whose_inputs_are_unheard_makes_the_node_wait() -> None:
    both = next(p for p in V0.members if p in V1.members)
    node = node_of(both)
    content = "ab" * 32
    assert move_to_next_view(
        node, {p: content for p in [p for p in V0.members if p != both][:2]}, 2.0
    )
    assert node.views is not None and node.views.lock == content
    opening = node.open_view(params_for, 2.0)
    assert opening.seating is Seating.WAITING and node.round is None


def test_a_vote_is_due_after_the_view_timeout_and_the_round_then_signs_nothing() -> None:
    node = node_of(V0.members[0])
    node.open_view(params_for, 0.0)
    assert node.vote_due(TIMEOUT - 1) is None
    intent = node.vote_due(TIMEOUT)
    assert intent is not None and node.round is not None and node.round.abandoned
    assert (intent.version, intent.view, intent.signed) == (VERSION + 1, 0, None)
    assert set(intent.recipients) == (set(V0.members) | set(V1.members)) - {V0.members[0]}
    st = node.views
    assert st is not None
    st.cast(sign_vote(BY_PEER[V0.members[0]], RUN, st.version, 0, None), TIMEOUT)
    assert node.vote_due(TIMEOUT + 1) is None  # voted in this view
    # a pooled state (the simulator's) asks for any member, told whether it voted
    assert leave_view(st, None, TIMEOUT + 1, V0.members[1]) is not None
    assert leave_view(st, None, TIMEOUT + 1, V0.members[1], voted=True) is None


def test_proposals_for_other_views_and_versions_are_refused_with_retry_or_closed() -> None:
    both = next(p for p in V0.members if p in V1.members)
    node = node_of(both)
    node.open_view(params_for, 0.0)
    leader = V0.members[0]
    d = (sub(20).digest,)
    assert node.on_proposal(leader, VERSION + 1, 1, d, 0, 1.0)[0] == (
        Reason.NO_OPEN_ROUND,
        "proposal for view 1; this syncer is in 0",
    )
    assert node.on_proposal(leader, VERSION + 2, 0, d, 0, 1.0)[0] is not None
    move_to_next_view(node, {p: None for p in V0.members[:2]}, 2.0)
    node.open_view(params_for, 2.0)
    refusal, actions, adopted = node.on_proposal(leader, VERSION + 1, 0, d, 0, 3.0)
    assert refusal is not None and refusal[0] is Reason.ROUND_CLOSED
    assert actions == [] and not adopted


def test_a_fellow_adopting_the_leaders_set_passes_it_on_once() -> None:
    leader = V0.members[0]
    follower = node_of(V0.members[1])
    follower.open_view(params_for, 0.0)
    s = sub(30)
    assert follower.on_submission(s, "p", 1.0)[0].accepted
    refusal, _, adopted = follower.on_proposal(leader, VERSION + 1, 0, (s.digest,), 0, 2.0)
    assert refusal is None and adopted
    assert follower.on_proposal(leader, VERSION + 1, 0, (s.digest,), 0, 3.0)[2] is False


def test_a_failed_merge_forgets_what_it_dropped() -> None:
    node = node_of(V0.members[0])
    node.open_view(params_for, 0.0)
    s = sub(40)
    node.on_submission(s, "p", 1.0)
    assert node.round is not None
    node.track([Dropped((s.digest,))])
    assert s.digest not in node.held


def test_early_committee_messages_wait_for_their_version_within_bounds() -> None:
    node = node_of(V0.members[0])
    assert not node.buffer_if_early(VERSION + 1, "now")  # its round is the current one
    assert node.buffer_if_early(VERSION + 2, "next")
    assert node.buffer_if_early(VERSION + 1 + EARLY_VERSIONS, "last")
    assert not node.buffer_if_early(VERSION + 2 + EARLY_VERSIONS, "too far")
    node.open_view(params_for, 0.0)
    assert node.on_submission(sub(50), "p", 0.5)[0].accepted
    assert node.install(PREV, VERSION, 1.0) is None  # not newer: nothing changes
    next_cert = view_cert(M, PREV, 0, [])  # version VERSION + 1 certified
    assert node.install(next_cert, VERSION + 1, 1.0) == ["next"]
    assert node.version == VERSION + 1
    assert node.buffered == [(VERSION + 1 + EARLY_VERSIONS, "last")] and node.held == {}
    for i in range(MAX_BUFFERED + 5):
        node.buffer_if_early(VERSION + 3, str(i))
    assert len(node.buffered) == MAX_BUFFERED
