"""LearnerMachine under random event sequences: the invariants of every walk."""

from __future__ import annotations

import random

import pytest

from p2pdiloco.core.learner import (
    CatchUp,
    Drop,
    LearnerAction,
    LearnerMachine,
    Rebase,
    Send,
    Train,
)
from p2pdiloco.protocol.reasons import Reason

# -- invariants under random events ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_random_events_keep_the_invariants(seed: int) -> None:
    rng = random.Random(seed)
    m = LearnerMachine(
        inner_steps=rng.randint(1, 6), chunk=rng.randint(1, 4), version=0, give_up_after=5.0
    )
    now = 0.0
    digests: list[str] = []  # every digest sealed so far, newest last
    outstanding = False  # a Send not yet settled by a Drop or an anchored Rebase
    last_version = m.version
    seen: set[type] = set()
    since_send = 0  # steps trained since the last Send

    def check(actions: list[LearnerAction]) -> None:
        nonlocal outstanding, last_version, since_send
        for a in actions:
            seen.add(type(a))
            if isinstance(a, Send):
                assert not outstanding, "two Sends without a settle in between"
                assert a.base_version == m.version
                # at least H; at most what was trained since, plus one carried delta (<= H)
                assert m.inner_steps <= a.steps <= since_send + m.inner_steps
                # overtime steps are steps of this delta, trained past its stretch
                assert 0 <= a.overtime <= a.steps - 1 and (a.overtime == 0 or a.steps > 1)
                outstanding, since_send = True, 0
            elif isinstance(a, Drop):
                assert outstanding, "Drop with nothing in flight"
                outstanding = False
            elif isinstance(a, Rebase):
                assert a.anchor_sent == outstanding
                assert not a.merged or a.anchor_sent
                assert a.version > last_version
                skipped = a.version > last_version + 1
                assert a.seek_step == (a.version * m.inner_steps if skipped else None)
                last_version = a.version
                outstanding = False
            elif isinstance(a, Train):
                assert 1 <= a.steps <= m.chunk
                # past H only in overtime: a delta in flight, trained on instead of waiting
                assert m.trained + a.steps <= m.inner_steps or m.in_flight is not None
                since_send += a.steps
            elif isinstance(a, CatchUp):
                assert a.version > m.version
        assert min(m.sent, m.merged, m.lost, m.trained) >= 0
        assert m.sent == m.merged + m.lost + (m.in_flight is not None)
        assert outstanding == (m.in_flight is not None)
        assert m.version == last_version

    for _ in range(2000):
        now += rng.choice([0.0, 0.1, 1.0, 6.0])
        event = rng.random()
        codes = [rng.choice(sorted(Reason)), None]
        roll = rng.random()
        if digests and roll < 0.6:
            pick = digests[-1]  # most often about the delta in flight, if sealed
        elif digests and roll < 0.8:
            pick = rng.choice(digests)
        else:
            pick = "stray"
        if event < 0.45:
            actions = m.next_action(now)
            check(actions)
            for a in actions:
                if isinstance(a, Train):
                    m.on_trained(a.steps)
                elif isinstance(a, Send) and rng.random() < 0.9:
                    digests.append(f"d{len(digests)}")
                    m.on_sent(digests[-1])
            continue
        if event < 0.65:
            actions = m.on_reply(
                pick,
                accepted=rng.random() < 0.5,
                code=rng.choice(codes),
                fast_forward=rng.choice([None, m.version + rng.randint(-2, 3)]),
            )
        elif event < 0.75:
            actions = m.on_dropped(pick, rng.choice(sorted(Reason)))
        else:
            version = m.version + rng.choice([-1, 0, 1, 1, 1, 2, 4])
            merged = frozenset(rng.sample(digests, min(len(digests), 2)) + [pick])
            if rng.random() < 0.5:
                merged = frozenset()
            actions = m.on_certified(version, merged)
        check(actions)
    # The walk exercised every path, and never waited: without a stop target, nothing does.
    assert seen == {Train, Send, Drop, Rebase, CatchUp}
    assert m.merged > 0 and m.lost > 0
