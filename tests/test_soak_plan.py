"""The pure parts of ``bench/soak.py``: its fault plan and its verdicts, without a process."""

from __future__ import annotations

import pytest

from bench.chaos_verify import BOOTSTRAP
from bench.soak import RESTART, SIGINT, SIGKILL, make_plan, view_bound, went_backwards
from tests.test_ledger import MANIFEST


@pytest.mark.parametrize("seed", range(5))
def test_the_plan_stops_and_kills_one_volunteer_at_a_time_and_restarts_the_bootstrap_once(
    seed: int,
) -> None:
    names = ["v0", "v1", "v2"]
    plan = make_plan(seed, 20 * 60, names, (40.0, 90.0), (5.0, 20.0))
    assert plan == make_plan(seed, 20 * 60, names, (40.0, 90.0), (5.0, 20.0))  # replayable
    volunteers = [f for f in plan if f.target != BOOTSTRAP]
    assert {f.action for f in volunteers} == {SIGINT, SIGKILL, RESTART}
    boot = [f.action for f in plan if f.target == BOOTSTRAP]
    assert boot == [SIGINT, RESTART]
    down: set[str] = set()
    for f in volunteers:  # in time order: each leaves while nobody else is down, and returns
        if f.action == RESTART:
            down.remove(f.target)
        else:
            assert not down, (f, down)
            down.add(f.target)
    assert not down and all(f.t < 20 * 60 for f in plan)


def test_a_state_going_backwards_is_found_in_a_life_and_across_a_rejoin() -> None:
    versions = {
        "v0": [(1.0, 1), (2.0, 2), (3.0, 3)],
        "v1": [(1.0, 1), (2.0, 4), (9.0, 3), (10.0, 5)],  # rejoined from version 3 after 4
    }
    assert went_backwards(versions) == [{"node": "v1", "t": 9.0, "from": 4, "to": 3}]


def test_the_view_bound_allows_one_failed_view_and_the_next_backed_off() -> None:
    rules = MANIFEST.rules
    assert view_bound(MANIFEST) == rules.grace + rules.agree_timeout + 3 * rules.view_timeout_s
