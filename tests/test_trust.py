"""Trust (sync.trust, ADR 0016): a flood of fresh identities cannot close, fill, weigh down or
anchor a round, nor take a committee seat; a young run still starts."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from p2pdiloco.aggregate import screen
from p2pdiloco.core.roster import committee_for
from p2pdiloco.core.round import Aggregate, Phase, Propose, Reject, RoundParams, SyncerRound
from p2pdiloco.core.trust import (
    AWAITED_VERSIONS,
    cap_probation,
    learners_awaited,
    probation_room,
    round_trusted,
    trusted_count,
    trusted_peers,
)
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import SyncRules, WorkScoring
from p2pdiloco.sync.aggregator import MergeInput, merge_round
from p2pdiloco.train.outer import OuterConfig
from tests.test_roster import PEERS, RUN, certificate, entry, manifest
from tests.test_round import sub

HONEST = frozenset(f"learner{i}" for i in range(3))  # learner0..2 trusted, learner3.. fresh


def params(**kw: Any) -> RoundParams:
    base: dict[str, Any] = dict(
        run_id="run",
        version=10,
        committee=("s0", "s1", "s2", "s3"),
        quorum=3,
        active_learners=8,
        opened_at=0.0,
        grace=60.0,
        staleness=2,
        max_tokens_per_step=1000,
        weight_cap=1.0,
        linger=30.0,
        trusted=HONEST,
        probation_share=0.25,
    )
    base.update(kw)
    return RoundParams(**base)


def test_probation_room_keeps_fresh_inputs_within_the_share() -> None:
    assert [probation_room(t, 0.25) for t in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    for t in range(50):
        p = probation_room(t, 0.25)
        assert p <= 0.25 * (t + p) + 1e-9 and p + 1 > 0.25 * (t + p + 1)
    assert probation_room(3, 1.0) > 10**6


def test_cap_probation_scales_fresh_weight_to_the_share() -> None:
    weights = {"a": 1.0, "b": 1.0, "c": 1.0, "x": 10.0, "y": 10.0}
    out = cap_probation(weights, frozenset({"x", "y"}), 0.25)
    assert out["a"] == out["b"] == out["c"] == 1.0
    assert math.isclose((out["x"] + out["y"]) / sum(out.values()), 0.25)
    assert out["x"] == out["y"]
    small = {"a": 3.0, "x": 0.5}
    assert cap_probation(small, frozenset({"x"}), 0.25) == small  # already within the share


def test_fresh_submissions_never_close_a_round() -> None:
    r = SyncerRound(params(), "s1")  # s1 follows: leader s0
    for i in range(3, 8):  # five fresh identities: the whole learner quorum of 8 × 0.6
        r.on_submission(sub(i), 1.0)
    assert r.phase is Phase.COLLECTING
    assert r.on_tick(61.0) == [] and r.phase is Phase.COLLECTING  # not even at the deadline
    for i in range(3):
        r.on_submission(sub(i), 62.0)
    assert r.phase is Phase.AGREEING  # 3 trusted of min_learners 5: closed by the deadline


def test_the_leader_proposes_every_trusted_input_and_the_earliest_fresh_that_fit() -> None:
    r = SyncerRound(params(active_learners=3), "s0")
    for i in (3, 4, 5, 6, 7):  # the flood arrives first
        r.on_submission(sub(i), 1.0)
    actions: list = []
    for i in range(3):
        actions = r.on_submission(sub(i), 2.0)
    propose = next(a for a in actions if isinstance(a, Propose))
    assert propose.digests == ("d00", "d01", "d02", "d03")  # 3 trusted + room for 1
    agg = next(a for a in actions if isinstance(a, Aggregate))
    assert agg.trusted == (True, True, True, False) and agg.anchors() == agg.trusted
    share = agg.weights[3] / sum(agg.weights)
    assert share <= 0.25 + 1e-12


def test_the_room_goes_to_the_identities_closest_to_trust_first() -> None:
    """ADR 0040: with the roster's accepted counts (``progress``), the leader fills the
    probation room with the identity that needs the fewest more, arrival order between equals;
    so trust, and the room with it, grows fastest after a young run."""
    progress = {"learner3": 0, "learner4": 1, "learner5": 2, "learner6": 2}
    r = SyncerRound(params(active_learners=3, progress=progress), "s0")
    for i in (3, 4, 5, 6, 7):
        r.on_submission(sub(i), 1.0)
    actions: list = []
    for i in range(3):
        actions = r.on_submission(sub(i), 2.0)
    propose = next(a for a in actions if isinstance(a, Propose))
    assert propose.digests == ("d00", "d01", "d02", "d05")  # learner5: 2 credits, came first


def test_a_follower_refuses_a_set_with_too_many_fresh_inputs_and_the_leader_goes_silent() -> None:
    r = SyncerRound(params(active_learners=3), "s1")
    for i in (3, 4, 5, 0, 1, 2):
        r.on_submission(sub(i), 1.0)
    assert r.phase is Phase.AGREEING
    refusal = r.on_proposal("s0", ("d00", "d01", "d02", "d03", "d04"), 2.0)
    assert len(refusal) == 1 and isinstance(refusal[0], Reject)
    assert refusal[0].code is Reason.OVER_PROBATION and refusal[0].peer_id == "s0"
    assert r.input_set is None and not r.leader_silent(2.0) and r.leader_silent(81.0)
    ok = r.on_proposal("s0", ("d00", "d01", "d02", "d03"), 3.0)
    assert isinstance(ok[0], Aggregate)


def test_fresh_identities_cannot_fill_a_round() -> None:
    r = SyncerRound(params(max_inputs=8), "s1")
    codes = [r.on_submission(sub(i), 1.0) for i in range(3, 8)]
    assert codes[:2] == [[], []]  # room: 8 × 0.25 = 2 fresh held
    assert all(a[0].code is Reason.BUSY for a in codes[2:])
    assert r.on_submission(sub(0), 1.0) == []  # a trusted learner still gets in


def test_a_young_run_trusts_everyone() -> None:
    r = SyncerRound(params(trusted=None, active_learners=5), "s0")
    actions: list = []
    for i in range(3, 8):
        actions = r.on_submission(sub(i), 1.0)
    assert any(isinstance(a, Propose) and len(a.digests) == 5 for a in actions)
    agg = next(a for a in actions if isinstance(a, Aggregate))
    assert agg.trusted == () and agg.anchors() == (True,) * 5


def test_a_young_run_under_the_z_test_waits_for_its_founders() -> None:
    """ADR 0071: before anyone earned trust under the z test, only founders' deltas can be
    merged, so only they close a round. A README run certified nothing for 8 minutes when a round
    closed on a newcomer's delta alone (its merge failed, attempt after attempt) while the
    creator, told its own delta came late, waited for that round's certificate."""
    z = {"rules": {"work": WorkScoring.z_test().model_dump(mode="json")}}
    paired = {"rules": {"work": WorkScoring().model_dump(mode="json")}}
    creator = manifest(**z).creator
    assert round_trusted(manifest(**z), None) == {creator}  # the creator alone
    assert round_trusted(manifest(genesis_committee=PEERS[:3], **z), None) == set(PEERS[:3])
    assert round_trusted(manifest(**paired), None) is None  # ADR 0065's young run: everyone
    assert round_trusted(manifest(), None) is None
    assert learners_awaited(manifest(**z), None, [creator, "newcomer"]) == (2, 1)
    earned = certificate([entry(p, 0, 3, 1000, 8) for p in PEERS[4:8]], version=8)
    m = manifest(genesis_committee=PEERS[:4], committee_size=4, **z)
    assert round_trusted(m, earned) == trusted_peers(m, earned)  # then as everywhere
    # In the round: a newcomer's delta never closes it, not even at the deadline; a
    # founder's does.
    r = SyncerRound(params(trusted=frozenset({"learner0"}), active_learners=2), "s1")
    r.on_submission(sub(3), 1.0)
    assert r.on_tick(61.0) == [] and r.phase is Phase.COLLECTING
    r.on_submission(sub(0), 62.0)
    assert r.phase is Phase.AGREEING


def test_trust_is_earned_on_the_certified_roster() -> None:
    m = manifest(genesis_committee=PEERS[:4], committee_size=4)
    vets = [entry(p, 0, 3, 1000, 8) for p in PEERS[4:8]]  # 3 accepted, joined 8 versions ago
    fresh = [entry(p, 6, 9, 10**9, 8) for p in PEERS[8:12]]  # big claims, too young
    assert trusted_peers(m, certificate(vets + fresh, version=8)) == frozenset(PEERS[:8])
    few = [entry(p, 0, 2, 1000, 8) for p in PEERS[4:8]]  # 2 accepted: not earned yet
    assert trusted_peers(m, certificate(few + fresh, version=8)) is None  # young run
    assert trusted_peers(m, None) is None


def test_a_round_waits_for_trusted_learners_only() -> None:
    """A flood of fresh live identities does not raise the count a round waits for (they
    never close it, so counting them kept every round open to its grace)."""
    m = manifest(genesis_committee=PEERS[:4], committee_size=4)
    vets = [entry(p, 0, 3, 1000, 8) for p in PEERS[4:8]]
    cert = certificate(vets, version=8)
    flood = [f"sybil{i}" for i in range(500)]
    assert learners_awaited(m, cert, [*PEERS[4:7], *flood]) == (503, 4)  # the roster's earned
    assert learners_awaited(m, cert, [*PEERS[:8], *flood]) == (508, 8)  # + the genesis members
    assert trusted_count(None, flood) == 500  # a young run waits for everyone
    assert learners_awaited(m, None, flood) == (500, 500)


def test_a_round_does_not_wait_for_roster_identities_idle_past_three_versions() -> None:
    """ADR 0045: the roster keeps an idle identity and its progress for ``roster_window`` (10)
    versions, but a round waits only for those active in the last ``AWAITED_VERSIONS`` (3):
    ones that left must not hold it open."""
    m = manifest(genesis_committee=PEERS[:4], committee_size=4)
    active = [entry(p, 0, 3, 1000, 8) for p in PEERS[4:8]]
    gone = [entry(p, 0, 3, 1000, 8 - AWAITED_VERSIONS - 1) for p in PEERS[8:12]]
    cert = certificate(active + gone, version=8)
    assert trusted_peers(m, cert) == frozenset(PEERS[:12])  # still trusted while on the roster
    assert learners_awaited(m, cert, []) == (4, 4)  # the four active ones only
    edge = [entry(p, 0, 3, 1000, 8 - AWAITED_VERSIONS) for p in PEERS[8:12]]
    assert learners_awaited(m, certificate(active + edge, version=8), []) == (8, 8)


def test_the_learner_quorum_is_a_share_of_the_trusted_learners() -> None:
    p = params(active_learners=8, trusted_learners=3, linger=30.0)  # 5 live ones are fresh
    r = SyncerRound(p, "s1")
    r.on_submission(sub(0), 1.0)
    r.on_submission(sub(1), 2.0)  # 2 of 3 trusted: ceil(0.6 × 3)
    assert r.phase is Phase.COLLECTING and r.on_tick(31.0) == [] and r.phase is Phase.COLLECTING
    r.on_tick(32.0)  # a linger later, far before the grace (60 s)
    assert r.phase is Phase.AGREEING
    # Every trusted learner in while a fresh one still trains: not at once, a linger later.
    r = SyncerRound(p, "s1")
    for i in range(3):
        r.on_submission(sub(i), 1.0)
    assert r.phase is Phase.COLLECTING
    r.on_tick(31.0)
    assert r.phase is Phase.AGREEING


def test_a_round_closes_at_once_when_its_probation_room_is_full() -> None:
    """Every trusted learner in and as many fresh inputs as the set may hold next to them
    (room 1 next to 3 trusted at share 0.25): nothing a later fresh one sends could enter the
    input set, so the round does not linger for the 4 fresh ones still announced as live."""
    p = params(active_learners=8, trusted_learners=3, linger=30.0)
    r = SyncerRound(p, "s1")
    r.on_submission(sub(3), 0.5)  # fresh: fills the room once three are trusted
    for i in range(2):
        r.on_submission(sub(i), 1.0)
    assert r.phase is Phase.COLLECTING  # 2 of 3 trusted in: the quorum, then a linger
    r.on_submission(sub(2), 2.0)
    assert r.phase is Phase.AGREEING and r.closed_at == 2.0


def test_fresh_identities_sit_only_after_every_eligible_one() -> None:
    m = manifest(committee_size=4)  # quorum 3: view j starts at 2j of the ranking
    vets = [entry(p, 0, 5, 1000, 8) for p in PEERS[:8]]
    sybils = [entry(p, 6, 9, 10**12, 8) for p in PEERS[8:12]]  # most tokens, joined 2 ago
    cert = certificate(vets + sybils, version=8)
    for view in range(3):  # windows 0–3, 2–5, 4–7 of the ranking: the 8 eligible
        assert set(committee_for(RUN, m, cert, view=view).members) <= set(PEERS[:8]), view


def test_a_later_view_finds_a_live_quorum_when_eligible_members_are_down() -> None:
    m = manifest(committee_size=4)
    eligible = [entry(p, 0, 5, 1000, 8) for p in PEERS[:4]]  # exactly k eligible
    newer = [entry(p, 7, 1, 100, 8) for p in PEERS[4:6]]  # live, not yet eligible
    cert = certificate(eligible + newer, version=8)
    views = [committee_for(RUN, m, cert, view=v).members for v in range(8)]
    for dead in itertools.combinations(PEERS[:4], 2):  # two eligible syncers killed
        assert any(sum(p not in dead for p in members) >= 3 for members in views), dead


def test_young_committees_prefer_the_creators_genesis_members() -> None:
    m = manifest(genesis_committee=PEERS[8:12], committee_size=4)
    early = [entry(p, 0, 1, 10**6, 1) for p in PEERS[:8]]  # fresh, but joined at 0 too
    genesis = [entry(p, 0, 1, 10, 1) for p in PEERS[8:12]]
    info = committee_for(RUN, m, certificate(early + genesis, version=1))
    assert set(info.members) == set(PEERS[8:12])


def test_screening_is_anchored_on_trusted_norms() -> None:
    gen = torch.Generator().manual_seed(0)
    honest = [1e-3 * torch.randn(64, generator=gen) for _ in range(3)]
    poison = [0.05 * torch.randn(64, generator=gen) for _ in range(5)]
    rows = torch.stack(honest + poison)
    assert screen(rows).rejected == {}  # the flood owns the round's median
    anchored = screen(rows, reference=[0, 1, 2])
    assert sorted(anchored.rejected) == [3, 4, 5, 6, 7]
    params = {"w": torch.zeros(64)}
    inputs = [
        MergeInput(f"d{i}", f"p{i}", {"w": d}, 1.0, trusted=i < 3)
        for i, d in enumerate(honest + poison)
    ]
    result = merge_round(params, {}, inputs, rules=SyncRules(), outer=OuterConfig())
    assert result.accepted == ["d0", "d1", "d2"] and len(result.rejected) == 5


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_weights_and_room_hold_for_any_share(share: float) -> None:
    r = SyncerRound(params(active_learners=3, probation_share=share), "s0")
    actions: list = []
    for i in list(range(3, 8)) + [0, 1, 2]:
        actions = r.on_submission(sub(i, tokens=9000 if i > 2 else 1000), 1.0) or actions
    agg = next(a for a in actions if isinstance(a, Aggregate))
    fresh = sum(w for w, t in zip(agg.weights, agg.anchors(), strict=True) if not t)
    assert fresh <= share * sum(agg.weights) + 1e-12
    assert len(agg.digests) - 3 == probation_room(3, share)


def test_a_fresh_delta_pointing_away_from_trusted_work_is_screened_out() -> None:
    gen = torch.Generator().manual_seed(3)
    common = 1e-3 * torch.randn(256, generator=gen)
    honest = [common + 5e-4 * torch.randn(256, generator=gen) for _ in range(4)]
    flipped = -honest[0]  # same norm as honest work, opposite direction
    late = common + 5e-4 * torch.randn(256, generator=gen)  # an honest newcomer
    deltas = [*honest[:3], flipped, late, -honest[1]]
    trusted = [True, True, True, False, False, True]  # a trusted flip is the rule's business
    inputs = [
        MergeInput(f"d{i}", f"p{i}", {"w": d}, 1.0, trusted=t)
        for i, (d, t) in enumerate(zip(deltas, trusted, strict=True))
    ]
    params = {"w": torch.zeros(256)}
    result = merge_round(params, {}, inputs, rules=SyncRules(), outer=OuterConfig())
    assert list(result.rejected) == ["d3"] and "points away" in result.rejected["d3"]
    assert result.accepted == ["d0", "d1", "d2", "d4", "d5"]
    again = merge_round(params, {}, inputs, rules=SyncRules(), outer=OuterConfig())
    assert torch.equal(again.params["w"], result.params["w"])


def test_with_work_scoring_a_young_run_trusts_only_scored_work() -> None:
    m = manifest(genesis_committee=PEERS[:1], committee_size=4, rules={"work": {}})
    worked = [entry(p, 0, 1, 1000, 1) for p in PEERS[4:6]]  # one scored receipt each
    cert = certificate(worked, version=1)
    trusted = trusted_peers(m, cert)
    assert trusted == frozenset([PEERS[0], *PEERS[4:6]])  # not whoever arrives next
    assert PEERS[8] not in trusted
    assert trusted_peers(m, None) is None  # before any receipt the run must start
    plain = manifest(genesis_committee=PEERS[:1], committee_size=4)
    assert trusted_peers(plain, certificate(worked, version=1)) is None  # as before


def test_a_run_that_scores_work_lets_one_newcomer_in_next_to_a_lone_trusted_learner() -> None:
    """ADR 0066: next to one trusted learner the room at share 0.25 is ⌊1/3⌋ = 0, so a young
    run of one genesis member closed every round on its creator's delta and a second volunteer
    never got a delta in, never earned a receipt, never became trusted (stop 49's README walk).
    A run that scores work holds at least one probationary input: the round lingers for it,
    the leader proposes it, a follower adopts the set, and its weight stays within the share."""
    assert [probation_room(t, 0.25, floor=1) for t in range(5)] == [1, 1, 1, 1, 1]
    lone = dict(trusted=frozenset({"learner0"}), active_learners=2, trusted_learners=1)
    plain = SyncerRound(params(**lone), "s0")
    plain.on_submission(sub(0), 1.0)
    assert plain.phase is not Phase.COLLECTING  # room 0: closed on the trusted one alone

    r = SyncerRound(params(**lone, probation_floor=1), "s0")
    r.on_submission(sub(0), 1.0)
    assert r.phase is Phase.COLLECTING  # the newcomer is awaited, by the linger at most
    actions = r.on_submission(sub(1), 2.0)
    propose = next(a for a in actions if isinstance(a, Propose))
    assert propose.digests == ("d00", "d01")
    agg = next(a for a in actions if isinstance(a, Aggregate))
    assert agg.weights[1] / sum(agg.weights) <= 0.25 + 1e-12
    follower = SyncerRound(params(**lone, probation_floor=1), "s1")
    follower.on_submission(sub(0), 1.0)
    follower.on_submission(sub(1), 2.0)
    adopted = follower.on_proposal("s0", propose.digests, 2.5, propose.attempt)
    assert [type(a) for a in adopted] == [Aggregate]
