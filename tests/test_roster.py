"""The certified roster: arithmetic, expiry, cap, and the committee every node derives from it."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace
from typing import Any

import pytest

from p2pdiloco.core import committee
from p2pdiloco.core.roster import (
    MAX_ROSTER,
    ROSTER_WINDOW,
    CommitteeInfo,
    beacon_of,
    committee_for,
    genesis_roster,
    next_roster,
    roster_of,
    verify_successor,
)
from p2pdiloco.protocol.certificates import (
    Accepted,
    Certificate,
    CertificateBody,
    RosterEntry,
    assemble,
    content_json,
    parse_certificate,
    roster_digest,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest, run_id_of
from p2pdiloco.protocol.signing import InvalidRecord

RUN = "ab" * 32
IDS = [Identity.from_seed(hashlib.sha256(b"roster%d" % i).digest()) for i in range(12)]
PEERS = sorted(i.peer_id for i in IDS)
CREATOR = IDS[0]


def manifest(**over: Any) -> RunManifest:
    body: dict[str, Any] = {
        "protocol_version": 1,
        "name": "roster-test",
        "model": "gpt-tiny",
        "data": "embedded",
        "seed": 0,
        "creator": CREATOR.peer_id,
        "created_at": 1_800_000_000.0,
        "committee_size": 4,
        "inner_steps": 20,
    }
    body.update(over)
    return RunManifest.model_validate(body)


def entry(peer: str, joined: int, accepted: int, tokens: int, last: int) -> RosterEntry:
    return RosterEntry(
        peer_id=peer, joined_version=joined, accepted=accepted, tokens=tokens, last_version=last
    )


def receipt(peer: str, tokens: int, n: int = 0) -> Accepted:
    digest = hashlib.sha256(f"{peer}/{tokens}/{n}".encode()).hexdigest()
    return Accepted(peer_id=peer, digest=digest, steps=1, tokens=tokens)


def certificate(
    roster: list[RosterEntry], *, version: int = 8, signers: int = 4, **over: Any
) -> Certificate:
    syncers = IDS[:4]
    fields: dict[str, Any] = {
        "run": RUN,
        "version": version,
        "base_version": version - 1,
        "state_hash": "cd" * 32,
        "committee": [s.peer_id for s in syncers],
        "quorum": 3,
        "accepted": [],
        "roster_hash": roster_digest(roster),
    }
    fields.update(over)
    body = CertificateBody(**fields)
    sigs = {s.peer_id: sign_body(s, body) for s in syncers[:signers]}
    # As verified: with the roster whose hash it carries (ADR 0044)
    return replace(parse_certificate(assemble(body, sigs), run_id=RUN), roster=tuple(roster))


def veterans(peers: list[str], version: int = 8) -> list[RosterEntry]:
    return [entry(p, 0, 5, 1000, version) for p in sorted(peers)]


# ---------------------------------------------------------------------------------------------
# genesis and the manifest


def test_genesis_is_the_creator_alone_by_default() -> None:
    m = manifest()
    assert m.genesis_committee == []
    assert genesis_roster(m) == [entry(CREATOR.peer_id, 0, 0, 0, 0)]
    assert roster_of(m, None) == genesis_roster(m)
    info = committee_for(RUN, m, None)
    assert info == CommitteeInfo(version=1, members=(CREATOR.peer_id,), quorum=1)


def test_genesis_committee_is_sorted_and_seats_its_members() -> None:
    chosen = [IDS[5].peer_id, IDS[3].peer_id, IDS[9].peer_id]
    m = manifest(genesis_committee=chosen)
    assert [e.peer_id for e in genesis_roster(m)] == sorted(chosen)
    assert all(
        (e.joined_version, e.accepted, e.tokens, e.last_version) == (0, 0, 0, 0)
        for e in genesis_roster(m)
    )
    info = committee_for(RUN, m, None)
    # three of k = 4, q = 3: the short quorum that tolerates the manifest's one absence (ADR 0055)
    assert sorted(info.members) == sorted(chosen) and info.quorum == committee.short_quorum(3) == 2
    assert CREATOR.peer_id not in info.members  # the creator named others
    # more genesis members than seats: a full committee at the manifest's quorum
    big = manifest(genesis_committee=PEERS[:7])
    full = committee_for(RUN, big, None)
    assert len(full.members) == 4 and set(full.members) <= set(PEERS[:7])
    assert full.quorum == big.quorum == 3


def test_manifest_genesis_committee_validation_and_run_id() -> None:
    with pytest.raises(ValueError, match="genesis committee must not repeat"):
        manifest(genesis_committee=[PEERS[0], PEERS[0]])
    with pytest.raises(ValueError, match="genesis_committee"):
        manifest(genesis_committee=["12D3KooWnotapeerid"])
    with pytest.raises(ValueError, match="genesis_committee"):
        manifest(genesis_committee=[PEERS[0]] * 65)
    base = run_id_of(manifest())
    assert run_id_of(manifest(genesis_committee=[])) == base
    assert run_id_of(manifest(genesis_committee=PEERS[:2])) != base
    assert "genesis_committee" in manifest().model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# next_roster


def test_next_roster_matches_a_hand_computed_example() -> None:
    a, b, c, d, e = PEERS[:5]
    prev = [
        entry(a, joined=0, accepted=2, tokens=300, last=4),
        entry(b, joined=1, accepted=1, tokens=50, last=2),  # idle 3 versions at v5: stays
        entry(c, joined=0, accepted=0, tokens=0, last=0),  # genesis member, never contributed
        entry(e, joined=1, accepted=1, tokens=9, last=1),  # idle 4 versions at v5: expires
    ]
    accepted = [receipt(a, 100), receipt(d, 7), receipt(a, 20, n=1)]
    got = next_roster(prev, new_version=5, accepted=accepted, window=3)
    assert got == [
        entry(a, joined=0, accepted=4, tokens=420, last=5),
        entry(b, joined=1, accepted=1, tokens=50, last=2),
        entry(d, joined=4, accepted=1, tokens=7, last=5),  # new: joined at the base it used
    ]
    assert [x.peer_id for x in got] == sorted(x.peer_id for x in got)


def test_window_expiry_counts_from_the_last_accepted_delta() -> None:
    a, b = PEERS[:2]
    roster = [entry(a, 0, 1, 10, 5), entry(b, 0, 1, 10, 5)]
    for v in range(6, 6 + ROSTER_WINDOW):
        roster = next_roster(roster, new_version=v, accepted=[receipt(b, 1, n=v)])
        assert [x.peer_id for x in roster] == [a, b]
    roster = next_roster(roster, new_version=6 + ROSTER_WINDOW, accepted=[])
    assert [x.peer_id for x in roster] == [b]  # a idle for window + 1 versions
    assert next_roster([entry(a, 0, 1, 10, 5)], new_version=6, accepted=[], window=0) == []
    # a peer that joined late is measured from its joining, whatever its last_version says
    assert next_roster([entry(a, 7, 0, 0, 0)], new_version=10, accepted=[], window=3) != []
    assert next_roster([entry(a, 7, 0, 0, 0)], new_version=11, accepted=[], window=3) == []


def test_roster_is_capped_by_recency_then_tokens_then_peer_id() -> None:
    ids = sorted(
        Identity.from_seed(hashlib.sha256(b"cap%d" % i).digest()).peer_id
        for i in range(MAX_ROSTER + 2)
    )
    old, new = ids[:MAX_ROSTER], ids[MAX_ROSTER:]
    prev = [entry(p, 0, 1, 5, 9) for p in old[:-1]] + [entry(old[-1], 0, 1, 6, 9)]
    got = next_roster(prev, new_version=10, accepted=[receipt(p, 1) for p in new])
    assert len(got) == MAX_ROSTER
    kept = {x.peer_id for x in got}
    assert set(new) <= kept  # most recent
    assert old[-1] in kept  # heaviest of the rest, despite the highest peer id
    assert kept.isdisjoint(old[-3:-1])  # ties broken by peer id: the highest two go
    assert [x.peer_id for x in got] == sorted(kept)


def test_next_roster_is_deterministic_and_pure() -> None:
    prev = [entry(p, i % 3, i, 100 * i, 6 + i % 3) for i, p in enumerate(PEERS)]
    accepted = [receipt(p, 10 + i, n=i) for i, p in enumerate(PEERS[::2] * 2)]
    expected = next_roster(prev, new_version=9, accepted=accepted)
    rng = random.Random(0)
    for _ in range(20):
        p, a = prev[:], accepted[:]
        rng.shuffle(p)
        rng.shuffle(a)
        assert next_roster(p, new_version=9, accepted=a) == expected
    assert prev == [entry(p, i % 3, i, 100 * i, 6 + i % 3) for i, p in enumerate(PEERS)]
    with pytest.raises(ValueError, match="repeats"):
        next_roster(prev + prev[:1], new_version=9, accepted=[])
    with pytest.raises(ValueError):
        next_roster(prev, new_version=0, accepted=[])


def test_counters_saturate_instead_of_overflowing() -> None:
    top = 2**63 - 1
    got = next_roster(
        [entry(PEERS[0], 0, top, top - 5, 3)],
        new_version=4,
        accepted=[receipt(PEERS[0], 10**15)],
    )
    assert (got[0].accepted, got[0].tokens) == (top, top)


def test_a_certified_roster_feeds_the_next_one() -> None:
    m = manifest(genesis_committee=PEERS[:4])
    learners = PEERS[4:8]
    roster1 = next_roster(
        genesis_roster(m), new_version=1, accepted=[receipt(p, 100) for p in learners]
    )
    cert1 = certificate(roster1, version=1)
    assert roster_of(m, cert1) == roster1
    info = committee_for(RUN, m, cert1)
    # young run: nobody is eligible yet, the oldest members (all joined at 0) top up by peer id
    assert info.version == 2 and sorted(info.members) == sorted(PEERS[:4])


# ---------------------------------------------------------------------------------------------
# committee_for


def test_same_body_different_signatures_same_committee() -> None:
    m = manifest()
    roster = veterans(PEERS[:10])
    three = certificate(roster, signers=3)
    four = certificate(roster, signers=4)
    assert three.raw != four.raw and three.body == four.body
    assert beacon_of(RUN, three) == beacon_of(RUN, four)
    # over the certified content: the body without its view, committee and quorum
    assert beacon_of(RUN, three) == committee.beacon(RUN, content_json(three.body))
    assert committee_for(RUN, m, three) == committee_for(RUN, m, four)
    info = committee_for(RUN, m, four)
    assert info.version == 9 and len(info.members) == 4 and info.quorum == m.quorum == 3
    assert set(info.members) <= set(PEERS[:10])
    assert info.members == tuple(
        committee.elect(
            [committee.Candidate(e.peer_id, 0, 5, 1000) for e in roster],
            version=8,
            beacon_bytes=beacon_of(RUN, four),
            rules=committee.CommitteeRules(size=4),
        )
    )


def test_committee_follows_the_certified_body() -> None:
    m = manifest()
    roster = veterans(PEERS[:10])
    draws = {
        committee_for(RUN, m, certificate(roster, state_hash=f"{i:02x}" * 32)).members
        for i in range(8)
    }
    assert len(draws) > 1
    assert beacon_of(RUN, None) == committee.beacon(RUN, None)
    assert beacon_of(RUN, certificate(roster)) != beacon_of(RUN, None)
    # a fresh learner (accepted this version) does not sit while enough veterans qualify
    fresh = next_roster(roster, new_version=9, accepted=[receipt(PEERS[11], 10**9)])
    for i in range(8):
        cert = certificate(fresh, version=9, state_hash=f"{i:02x}" * 32)
        assert PEERS[11] not in committee_for(RUN, m, cert).members


def test_short_roster_gets_a_quorum_of_its_size() -> None:
    m = manifest()
    two = committee_for(RUN, m, certificate(veterans(PEERS[:2])))
    assert len(two.members) == 2 and two.quorum == committee.quorum(2) == 2
    five = committee_for(RUN, m, certificate(veterans(PEERS[:5])))
    assert len(five.members) == 4 and five.quorum == 3
    strict = manifest(quorum=4)
    assert committee_for(RUN, strict, certificate(veterans(PEERS[:5]))).quorum == 4
    assert committee_for(RUN, strict, certificate(veterans(PEERS[:3]))).quorum == 3
    # the default k = 4, q = 3 tolerates one absence; three members keep that (ADR 0055)
    assert committee_for(RUN, m, certificate(veterans(PEERS[:3]))).quorum == 2
    for n in range(1, 10):  # the short quorum is safe: two quorums share f + 1 members
        q, f = committee.short_quorum(n), (n - 1) // 3
        assert 2 * q - n >= f + 1 and n - q >= f and q <= committee.quorum(n)


def test_a_committee_of_two_that_holds_a_founder_is_the_founders_alone() -> None:
    """ADR 0073: a committee of one or two tolerates no fault, so beside a founder a newcomer
    adds no safety, only a departure that stops the run (both votes certify or end a view)."""
    founder, newcomer, third = CREATOR.peer_id, IDS[1].peer_id, IDS[2].peer_id
    m = manifest(committee_size=3)
    pair = certificate(veterans([founder, newcomer]))
    alone = committee_for(RUN, m, pair)
    assert alone.members == (founder,) and alone.quorum == 1
    # later views rotate over the founders only: never the newcomer alone
    for view in range(1, 6):
        assert committee_for(RUN, m, pair, view).members == (founder,)
    # the genesis committee are the founders: two of them sit together, a newcomer beside one
    # of them (the other idle off the roster) does not
    named = manifest(committee_size=3, genesis_committee=[IDS[4].peer_id, IDS[5].peer_id])
    both = committee_for(RUN, named, certificate(veterans([IDS[4].peer_id, IDS[5].peer_id])))
    assert sorted(both.members) == sorted([IDS[4].peer_id, IDS[5].peer_id]) and both.quorum == 2
    one = committee_for(RUN, named, certificate(veterans([IDS[4].peer_id, newcomer])))
    assert one.members == (IDS[4].peer_id,) and one.quorum == 1
    # unchanged: three members or more, a creator who chose k = 2, a pair without a founder
    three = committee_for(RUN, m, certificate(veterans([founder, newcomer, third])))
    assert len(three.members) == 3 and three.quorum == m.quorum
    chosen = committee_for(RUN, manifest(committee_size=2), pair)
    assert sorted(chosen.members) == sorted([founder, newcomer]) and chosen.quorum == 2
    strangers = committee_for(RUN, m, certificate(veterans([newcomer, third])))
    assert sorted(strangers.members) == sorted([newcomer, third]) and strangers.quorum == 2


def test_empty_certified_roster_falls_back_to_genesis_and_runs_must_match() -> None:
    m = manifest()
    empty = certificate([])
    assert roster_of(m, empty) == genesis_roster(m)
    info = committee_for(RUN, m, empty)
    assert info == CommitteeInfo(version=9, members=(CREATOR.peer_id,), quorum=1)
    with pytest.raises(ValueError, match="another run"):
        committee_for("ef" * 32, m, empty)


# ---------------------------------------------------------------------------------------------
# verify_successor

BY_PEER = {i.peer_id: i for i in IDS}


def successor(
    m: RunManifest, prev: Certificate | None, accepted: list[Accepted], **over: Any
) -> Certificate:
    """The certificate an honest elected committee would produce after ``prev``, signed by all
    of whoever ``committee`` names (so parse_certificate accepts it), with ``over`` applied; it
    holds the honest roster, as a node that verified it would (``verify_successor`` derives its
    own)."""
    info = committee_for(RUN, m, prev)
    accepted = sorted(accepted, key=lambda a: a.digest)
    roster = next_roster(
        roster_of(m, prev),
        new_version=info.version,
        accepted=accepted,
        window=m.rules.roster_window,
    )
    fields: dict[str, Any] = {
        "run": RUN,
        "version": info.version,
        "base_version": info.version - 1,
        "state_hash": "cd" * 32,
        "committee": list(info.members),
        "quorum": info.quorum,
        "accepted": accepted,
        "roster_hash": roster_digest(roster),
    }
    fields.update(over)
    body = CertificateBody(**fields)
    signers = [BY_PEER[p] for p in body.committee]
    raw = assemble(body, {s.peer_id: sign_body(s, body) for s in signers})
    return replace(parse_certificate(raw), roster=tuple(roster))


def test_an_honest_chain_verifies() -> None:
    m = manifest(genesis_committee=PEERS[:4])
    prev: Certificate | None = None
    for v in range(1, 6):
        made = successor(m, prev, [receipt(p, 100 * v, n=v) for p in PEERS[4:10]])
        cert = verify_successor(RUN, m, prev, parse_certificate(made.raw))
        assert cert.roster == made.roster  # derived from the chain, not carried
        assert cert.body.version == v
        prev = cert
    assert prev is not None and prev.roster is not None
    # the genesis members, idle since version 0, stay for the manifest's window (10)
    assert {e.peer_id for e in prev.roster} == set(PEERS[:10])
    short = manifest(genesis_committee=PEERS[:4], rules={"roster_window": 3})
    prev = None
    for v in range(1, 6):
        made = successor(short, prev, [receipt(p, 100 * v, n=v) for p in PEERS[4:10]])
        prev = verify_successor(RUN, short, prev, parse_certificate(made.raw))
    assert {e.peer_id for e in prev.roster or ()} == set(PEERS[4:10])  # theirs ran out


def test_self_appointed_and_altered_certificates_are_refused() -> None:
    m = manifest(genesis_committee=PEERS[:4])
    learners = [receipt(p, 100) for p in PEERS[4:8]]
    honest = verify_successor(RUN, m, None, successor(m, None, learners))
    assert honest.roster is not None
    outsider = PEERS[11]
    assert outsider not in honest.body.committee
    members = list(honest.body.committee)
    bad: dict[str, dict[str, Any]] = {
        "self-appointed": {"committee": [outsider], "quorum": 1},
        "reordered": {"committee": members[::-1]},
        "lower quorum": {"quorum": honest.body.quorum - 1},
        "inflated roster": {
            "roster_hash": roster_digest(
                [e.model_copy(update={"tokens": e.tokens * 10}) for e in honest.roster]
            )
        },
        "skipped version": {"version": 2, "base_version": 1},
    }
    for label, over in bad.items():
        forged = successor(m, None, learners, **over)  # parse_certificate accepts every one
        with pytest.raises(InvalidRecord, match="certificate") as info:
            verify_successor(RUN, m, None, forged)
        assert info.value.signer is None, label
    with pytest.raises(InvalidRecord, match="for run"):
        verify_successor("ef" * 32, m, None, honest)
    # the honest certificate of version 1 is no successor of itself
    with pytest.raises(InvalidRecord, match="moves 0 -> 1, expected 1 -> 2"):
        verify_successor(RUN, m, honest, honest)
