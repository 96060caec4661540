"""Committee election: deterministic, verifiable, weighted, Sybil-resistant."""

from __future__ import annotations

import collections

import pytest

from p2pdiloco.core.committee import (
    Candidate,
    CommitteeRules,
    beacon,
    elect,
    eligible,
    quorum,
    verify_committee,
)

RUN = "ab" * 32


def veterans(n: int, tokens: int = 1000) -> list[Candidate]:
    return [
        Candidate(f"peer{i:03d}", joined_version=0, accepted=5, accepted_tokens=tokens)
        for i in range(n)
    ]


def test_quorum_is_two_thirds_plus_one() -> None:
    assert [quorum(k) for k in (1, 2, 3, 4, 5, 6, 7, 10)] == [1, 2, 3, 3, 4, 5, 5, 7]
    with pytest.raises(ValueError):
        quorum(0)


def test_election_is_deterministic_and_verifiable() -> None:
    rules = CommitteeRules(size=4)
    b = beacon(RUN, b"certificate of v7")
    c1 = elect(veterans(20), version=8, beacon_bytes=b, rules=rules)
    c2 = elect(list(reversed(veterans(20))), version=8, beacon_bytes=b, rules=rules)
    assert c1 == c2 and len(c1) == 4 and len(set(c1)) == 4
    assert verify_committee(c1, veterans(20), version=8, beacon_bytes=b, rules=rules)
    assert not verify_committee(c1[::-1], veterans(20), version=8, beacon_bytes=b, rules=rules)
    other = elect(
        veterans(20), version=8, beacon_bytes=beacon(RUN, b"certificate of v8"), rules=rules
    )
    assert other != c1


def test_committee_rotates_across_rounds() -> None:
    rules = CommitteeRules(size=3)
    seats = collections.Counter()
    for v in range(200):
        seats.update(
            elect(
                veterans(12),
                version=v + 10,
                beacon_bytes=beacon(RUN, f"cert{v}".encode()),
                rules=rules,
            )
        )
    assert len(seats) == 12  # everyone serves sometimes
    assert max(seats.values()) < 3 * min(seats.values())


def test_banned_young_and_idle_peers_are_not_eligible_when_enough_veterans_exist() -> None:
    rules = CommitteeRules(size=3, min_age_versions=2, min_accepted=1)
    pool = veterans(5) + [
        Candidate("banned", 0, 9, 10**9, banned=True),
        Candidate("young", joined_version=9, accepted=3, accepted_tokens=10**6),
        Candidate("idle", joined_version=0, accepted=0),
    ]
    assert {c.peer_id for c in eligible(pool, 10, rules)} == {f"peer{i:03d}" for i in range(5)}
    for v in range(50):
        committee = elect(pool, version=10, beacon_bytes=beacon(RUN, bytes([v])), rules=rules)
        assert not {"banned", "young", "idle"} & set(committee)


def test_a_peer_whose_deltas_stopped_being_merged_is_not_drawn_once_recency_applies() -> None:
    rules = CommitteeRules(size=3, min_age_versions=2, min_accepted=1, recency=2)
    active = [
        Candidate(f"peer{i:03d}", 0, 5, 1000, last_version=v) for i, v in enumerate((10, 9, 10, 9))
    ]
    gone = Candidate("gone", joined_version=0, accepted=50, accepted_tokens=10**9, last_version=8)
    assert "gone" not in {c.peer_id for c in eligible([*active, gone], 10, rules)}
    for v in range(30):
        committee = elect(
            [*active, gone], version=10, beacon_bytes=beacon(RUN, bytes([v])), rules=rules
        )
        assert "gone" not in committee
    # Without the condition it would sit: it holds by far the most weight.
    loose = CommitteeRules(size=3, min_age_versions=2, min_accepted=1)
    assert "gone" in {c.peer_id for c in eligible([*active, gone], 10, loose)}


def test_sybil_flood_of_fresh_identities_never_sits() -> None:
    rules = CommitteeRules(size=4)
    pool = veterans(6) + [Candidate(f"sybil{i}", joined_version=99, accepted=0) for i in range(500)]
    for v in range(100):
        committee = elect(
            pool, version=100, beacon_bytes=beacon(RUN, f"c{v}".encode()), rules=rules
        )
        assert all(p.startswith("peer") for p in committee)


def test_young_run_tops_up_with_oldest_members() -> None:
    rules = CommitteeRules(size=3)
    pool = [Candidate(f"p{i}", joined_version=i) for i in range(5)]
    committee = elect(pool, version=0, beacon_bytes=beacon(RUN, None), rules=rules)
    assert set(committee) == {"p0", "p1", "p2"}
    assert elect(pool[:2], version=0, beacon_bytes=beacon(RUN, None), rules=rules) != []


def test_selection_frequency_follows_weight_with_a_cap() -> None:
    rules = CommitteeRules(size=1, weight_cap_fraction=1.0)
    pool = [Candidate("heavy", 0, 5, 3000), Candidate("light", 0, 5, 1000)]
    wins = collections.Counter(
        elect(pool, version=10, beacon_bytes=beacon(RUN, f"{i}".encode()), rules=rules)[0]
        for i in range(4000)
    )
    share = wins["heavy"] / 4000
    assert 0.71 < share < 0.79  # weighted rendezvous: P = 3000 / 4000
    capped = CommitteeRules(size=1, weight_cap_fraction=0.3)
    pool = [Candidate("whale", 0, 5, 10**9)] + veterans(9, tokens=1000)
    wins = collections.Counter(
        elect(pool, version=10, beacon_bytes=beacon(RUN, f"{i}".encode()), rules=capped)[0]
        for i in range(3000)
    )
    assert wins["whale"] / 3000 < 0.5  # capped at 30% of total weight, not ~100%
