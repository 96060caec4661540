"""The adaptive grace window (issue 10 item 4): twice the 90th percentile of recent arrival
delays, within the manifest's [grace_min, grace]; the manifest's grace when it is off."""

from __future__ import annotations

import pydantic
import pytest

from p2pdiloco.core.arrivals import FACTOR, ROUNDS_KEPT, ArrivalWindow
from p2pdiloco.protocol.records import SyncRules


def window(grace_min: float | None = 2.0, grace: float = 60.0) -> ArrivalWindow:
    return ArrivalWindow(grace, grace_min)


def test_off_without_a_lower_bound_and_until_arrivals_are_seen() -> None:
    off = window(grace_min=None)
    off.next_round()
    off.arrived(1.0)
    assert off.close_after() == 60.0
    assert window().next_round() == 60.0  # nothing seen yet


def test_twice_the_90th_percentile_of_arrivals_within_the_bounds() -> None:
    w = window()
    w.next_round()
    for d in range(1, 11):  # 1 … 10 s after the round opened
        w.arrived(float(d))
    assert w.next_round() == FACTOR * 9.0  # p90 of 1..10 is 9
    fast = window()
    fast.arrived(0.1)
    assert fast.close_after() == 2.0  # the lower bound
    slow = window()
    slow.arrived(50.0)
    assert slow.close_after() == 60.0  # the upper bound: the manifest's grace


def test_only_the_last_rounds_count() -> None:
    w = window()
    w.next_round()
    w.arrived(25.0)
    for _ in range(ROUNDS_KEPT):
        w.next_round()
        w.arrived(1.0)
    assert w.close_after() == 2.0  # the slow round has left the window


def test_bad_delays_are_ignored_and_negative_ones_count_as_zero() -> None:
    w = window()
    w.arrived(float("nan"))
    w.arrived(float("inf"))
    assert w.close_after() == 60.0
    w.arrived(-3.0)
    assert w.close_after() == 2.0


def test_the_manifest_refuses_a_lower_bound_above_the_grace() -> None:
    assert SyncRules(grace=10.0, grace_min=10.0).grace_min == 10.0
    with pytest.raises(pydantic.ValidationError, match="grace_min"):
        SyncRules(grace=10.0, grace_min=11.0)
