"""The sans-IO syncer round, driven in memory exactly as the node and the simulator drive it."""

from __future__ import annotations

import hashlib

import pytest

from p2pdiloco.sync.round import (
    Aggregate,
    Done,
    FastForward,
    Fetch,
    Phase,
    Propose,
    Reject,
    RoundParams,
    Sign,
    Submission,
    SyncerRound,
)

RUN = "run"
COMMITTEE = ("s0", "s1", "s2", "s3")


def params(**kw) -> RoundParams:
    base = dict(run_id=RUN, version=10, committee=COMMITTEE, quorum=3, active_learners=5,
                opened_at=0.0, grace=60.0, staleness=2, max_tokens_per_step=1000, weight_cap=0.5)  # fmt: skip
    base.update(kw)
    return RoundParams(**base)


def sub(i: int, base: int = 10, steps: int = 10, tokens: int = 5000, run: str = RUN) -> Submission:
    return Submission(f"learner{i}", run, base, steps, tokens, f"d{i:02d}")


def honest_hash(agg: Aggregate) -> str:
    return hashlib.sha256(repr((agg.digests, agg.weights)).encode()).hexdigest()


class Committee:
    """Routes actions between syncers in memory; ``byzantine`` syncers sign garbage."""

    def __init__(
        self,
        p: RoundParams,
        byzantine: frozenset[str] = frozenset(),
        down: frozenset[str] = frozenset(),
    ):
        self.rounds = {s: SyncerRound(p, s) for s in p.committee if s not in down}
        self.byzantine = byzantine
        self.done: dict[str, Done] = {}
        self.log: list[tuple[str, object]] = []

    def run(self, syncer: str, actions: list, now: float) -> None:
        queue = [(syncer, a) for a in actions]
        while queue:
            who, action = queue.pop(0)
            self.log.append((who, action))
            if isinstance(action, Propose):
                for other, r in self.rounds.items():
                    if other != who:
                        queue += [(other, a) for a in r.on_proposal(who, action.digests, now)]
            elif isinstance(action, Fetch):
                donor = self.rounds[action.from_peer]
                for d in action.digests:
                    queue += [(who, a) for a in self.rounds[who].on_fetched(donor.accepted[d])]
            elif isinstance(action, Aggregate):
                h = "evil" if who in self.byzantine else honest_hash(action)
                queue += [(who, a) for a in self.rounds[who].on_aggregated(h)]
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


def test_screening_rejects_and_fast_forwards() -> None:
    c = Committee(params())
    r = c.rounds["s1"]
    assert r.on_submission(sub(1, base=7), 1.0) == [
        Reject("learner1", "stale: base version 7 is older than 8"),
        FastForward("learner1", 10),
    ]
    assert "newer than the certified" in r.on_submission(sub(2, base=11), 1.0)[0].reason
    assert "another run" in r.on_submission(sub(3, run="other"), 1.0)[0].reason
    assert (
        "exceeds steps × batch × seq_len"
        in r.on_submission(sub(4, steps=2, tokens=2001), 1.0)[0].reason
    )
    assert r.on_submission(sub(5), 1.0) == []
    assert "duplicate" in r.on_submission(sub(5), 1.0)[0].reason
    again = Submission("learner5", RUN, 10, 10, 5000, "other-digest")
    assert "same learner" in r.on_submission(again, 1.0)[0].reason


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
    expected = honest_hash(Aggregate(digests, c.rounds["s0"].weights(digests)))
    assert {d.state_hash for d in c.done.values()} == {expected}
    assert "s3" not in next(iter(c.done.values())).signers
    assert c.done["s3"].agreed_with_quorum is False  # it learns it was the odd one out


def test_too_few_honest_syncers_certify_nothing() -> None:
    c = Committee(params(), byzantine=frozenset({"s2", "s3"}))
    for i in range(3):
        c.submit(sub(i), 1.0)
    assert not c.done  # 2 honest signatures < quorum 3; 2 garbage ones do not match


def test_leader_failure_rotates_to_the_next_syncer() -> None:
    c = Committee(params(agree_timeout=10.0), down=frozenset({"s0"}))
    for i in range(3):
        c.submit(sub(i), 1.0)
    assert not c.done  # s0 (leader) is down: nobody proposes yet
    assert c.rounds["s1"].phase is Phase.AGREEING
    c.tick(12.0)  # one agree_timeout later s1 leads
    assert set(c.done) == {"s1", "s2", "s3"}


def test_proposals_and_signatures_from_the_wrong_syncers_are_refused() -> None:
    r = SyncerRound(params(), "s1")
    r.on_submission(sub(0), 1.0)
    assert "not the current leader" in r.on_proposal("s2", ("d00",), 1.0)[0].reason
    assert "malformed" in r.on_proposal("s0", ("d01", "d00"), 1.0)[0].reason
    assert "outside the committee" in r.on_signature("mallory", "h")[0].reason
    r.on_signature("s2", "h1")
    assert "equivocation" in r.on_signature("s2", "h2")[0].reason
    with pytest.raises(ValueError):
        SyncerRound(params(), "outsider")
