"""The pure parts of ``bench/soak.py``: its fault plan and its verdicts, without a process."""

from __future__ import annotations

import pytest

from bench.chaos_verify import BOOTSTRAP, stall_allowance
from bench.soak import RESTART, SIGINT, SIGKILL, make_plan, view_bound, went_backwards
from p2pdiloco.core.views import view_start
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


def test_the_view_bound_is_one_failed_view_and_the_next_at_the_pacemakers_timeout() -> None:
    """The bound is the pacemaker's (core.views): view 0's timeout and view 1's, twice it but
    at most ``view_timeout_max``; chaos_verify's stall allowance is the same sum."""
    rules = MANIFEST.rules
    t = rules.view_timeout_s
    assert view_bound(MANIFEST) == view_start(rules, 2) == t + min(2 * t, rules.view_timeout_max_s)
    assert stall_allowance(MANIFEST) == view_bound(MANIFEST)
    assert stall_allowance(MANIFEST, failed_views=3) == view_start(rules, 4)
    capped = MANIFEST.model_copy(
        update={"rules": rules.model_copy(update={"view_timeout": 30.0, "view_timeout_max": 45.0})}
    )
    assert view_bound(capped) == 30.0 + 45.0  # view 1 waits the bound, not twice view 0
    assert stall_allowance(capped, failed_views=3) == 30.0 + 3 * 45.0
