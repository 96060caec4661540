"""Memory stays bounded whatever peers send: the replay guard, the log, the syncer round."""

from __future__ import annotations

import pytest

from p2pdiloco.core.bounded import BoundedLog, ReplayGuard
from p2pdiloco.core.round import (
    Aggregate,
    Dropped,
    Propose,
    Reject,
    RoundParams,
    Standing,
    Submission,
    SyncerRound,
)
from p2pdiloco.core.round_types import HELD_BYTES, MIN_HELD, held_cap
from p2pdiloco.protocol.certificates import MAX_RECEIPTS
from p2pdiloco.protocol.reasons import Reason

N = 100_000
STALENESS = 2


def test_replay_guard_stays_bounded_across_many_versions_and_catches_replays() -> None:
    guard = ReplayGuard.for_staleness(STALENESS, per_version_cap=4096)
    assert guard.window == STALENESS + 2
    bound_versions = guard.window + 1 + guard.lookahead
    per_version = 1000  # 100 versions of 1000 submissions each
    for i in range(N):
        version = i // per_version
        guard.advance(version)
        assert guard.add(f"{i:x}", version)
        if i % per_version == per_version - 1:
            assert guard.versions <= bound_versions
            assert len(guard) <= bound_versions * guard.per_version_cap
    last = N // per_version - 1
    assert guard.evicted == 0 and guard.versions == guard.window + 1
    # Replays inside the window are caught, at the current version and the oldest kept one.
    assert not guard.add(f"{N - 1:x}", last)
    oldest = last - guard.window
    assert not guard.add(f"{oldest * per_version:x}", oldest)
    assert (f"{oldest * per_version:x}", oldest) in guard
    # Older than the window: forgotten, reported new, and refused as stale by the round.
    too_old = oldest - 1
    assert guard.add(f"{too_old * per_version:x}", too_old)
    assert (f"{too_old * per_version:x}", too_old) not in guard
    rnd = SyncerRound(RoundParams("run", last, ("s0",), 1, 10, 0.0, staleness=STALENESS), "s0")
    stale = Submission("p", "run", too_old, 1, 1, f"{too_old * per_version:x}")
    assert rnd.on_submission(stale, 1.0)[0] == Reject(
        "p", Reason.STALE, f"stale: base version {too_old} is older than {last - STALENESS}"
    )
    # Versions far ahead are not remembered either (the round refuses them as too new).
    assert guard.add("future", last + guard.lookahead + 1)
    assert guard.versions == guard.window + 1


def test_a_member_holds_at_most_its_memory_of_payloads() -> None:
    # ADR 0047: max_inputs is HELD_BYTES over the largest payload, within [MIN_HELD, MAX_RECEIPTS].
    assert held_cap(1_000) == MAX_RECEIPTS
    assert held_cap(1_000_000) == HELD_BYTES // 1_000_000 < MAX_RECEIPTS
    assert held_cap(HELD_BYTES) == MIN_HELD  # one huge payload: still a few inputs a round
    assert held_cap(0) == MAX_RECEIPTS


def test_replay_guard_within_one_version_evicts_oldest_first() -> None:
    cap = 4096
    guard = ReplayGuard(window=STALENESS + 2, per_version_cap=cap, current_version=7)
    for i in range(N):
        assert guard.add(f"{i:x}", 7)
        assert len(guard) <= cap
    assert len(guard) == cap and guard.evicted == N - cap
    assert not guard.add(f"{N - 1:x}", 7)  # recent replays are still caught
    assert not guard.add(f"{N - cap:x}", 7)  # ... back to the oldest one kept
    assert guard.add(f"{0:x}", 7)  # the oldest were forgotten first


def test_replay_guard_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        ReplayGuard(window=-1)
    with pytest.raises(ValueError):
        ReplayGuard(window=2, per_version_cap=0)


def test_bounded_log_keeps_the_latest_and_counts_all() -> None:
    log: BoundedLog[tuple[str, Reason]] = BoundedLog(maxlen=1000)
    for i in range(N):
        log.append((f"peer{i}", Reason.STALE))
        assert len(log) <= log.maxlen
    assert len(log) == 1000 and log.total == N and log.forgotten == N - 1000
    assert [p for p, _ in log.latest(2)] == [f"peer{N - 2}", f"peer{N - 1}"]
    assert next(iter(log)) == (f"peer{N - 1000}", Reason.STALE)
    assert log.latest(0) == []
    with pytest.raises(ValueError):
        BoundedLog(maxlen=0)


def test_a_round_flooded_with_submissions_holds_at_most_max_inputs() -> None:
    p = RoundParams(
        "run",
        10,
        ("s0", "s1"),
        2,
        active_learners=10**9,
        opened_at=0.0,
        min_fraction=1.0,
        linger=1e9,
        grace=1e9,
    )
    r = SyncerRound(p, "s1")
    codes: dict[Reason, int] = {}
    for i in range(N):
        for a in r.on_submission(Submission(f"p{i}", "run", 10, 1, 1, f"{i:x}"), 1.0):
            assert isinstance(a, Reject)
            codes[a.code] = codes.get(a.code, 0) + 1
        assert len(r.accepted) <= p.max_inputs and len(r.by_peer) <= p.max_inputs
    assert codes == {Reason.BUSY: N - p.max_inputs}
    assert len(r.accepted) == p.max_inputs == MAX_RECEIPTS  # the default: what a certificate lists
    # A replay of an accepted submission is still caught while the round holds it.
    replay = r.on_submission(Submission("p5", "run", 10, 1, 1, f"{5:x}"), 1.0)
    assert [a.code for a in replay if isinstance(a, Reject)] == [Reason.DUPLICATE]


def test_a_round_failing_merge_after_merge_keeps_its_dropped_set_bounded() -> None:
    p = RoundParams(
        "run",
        10,
        ("s0",),
        1,
        active_learners=64,
        opened_at=0.0,
        min_fraction=1.0,
        weight_cap=1.0,
        max_inputs=64,
        max_dropped=256,
        grace=1e9,
    )
    r = SyncerRound(p, "s0")
    dropped = 0
    for i in range(N):
        for a in r.on_submission(Submission(f"p{i}", "run", 10, 1, 1, f"{i:x}"), float(i)):
            if isinstance(a, Aggregate):
                for b in r.on_merge_failed(float(i), attempt=a.attempt):
                    if isinstance(b, Dropped):
                        dropped += len(b.digests)
            else:
                assert isinstance(a, Propose)
        assert len(r.accepted) <= p.max_inputs and len(r.by_peer) <= p.max_inputs
        assert len(r.dropped) <= p.max_dropped
    assert r.attempt == N // 64 and dropped == r.attempt * 64
    assert len(r.dropped) == p.max_dropped
    # Dropped digests the round still remembers are refused when replayed; older ones are
    # forgotten (the driver's ReplayGuard still refuses those).
    recent = f"{r.attempt * 64 - 1:x}"
    assert r.status_of(recent).standing is Standing.DROPPED
    again = r.on_submission(Submission("x", "run", 10, 1, 1, recent), float(N))
    assert [a.code for a in again if isinstance(a, Reject)] == [Reason.MERGE_FAILED]
    assert r.status_of(f"{0:x}").standing is Standing.UNKNOWN
