"""The simulator's clock: events in time order, and the garbage collector held off while they
run, then given back as it was (ADR 0052)."""

from __future__ import annotations

import gc

import pytest

from p2pdiloco.sim.clock import COLLECT_EVERY, Clock


def test_events_run_in_time_order_ties_as_scheduled_with_the_collector_held_off() -> None:
    clock, seen = Clock(), []

    def note(name: str) -> None:
        seen.append((clock.now, name, gc.isenabled()))

    clock.at(2.0, note, "late")
    clock.at(1.0, note, "first")
    clock.at(1.0, note, "tie")
    clock.after(0.5, note, "early")
    was = gc.isenabled()
    gc.enable()
    try:
        clock.run(10.0)
        assert gc.isenabled()
    finally:
        if not was:
            gc.disable()
    assert seen == [
        (0.5, "early", False),
        (1.0, "first", False),
        (1.0, "tie", False),
        (2.0, "late", False),
    ]
    assert clock.now == 10.0 and clock.events == 4


def test_cycles_are_collected_each_simulated_hour_and_an_error_gives_the_collector_back() -> None:
    clock = Clock()
    collected: list[int] = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            collected.append(int(clock.now))

    def make_cycle() -> None:
        Cycle()  # unreachable at once, freed only by a collection

    def fail() -> None:
        raise RuntimeError("an event failed")

    clock.at(10.0, make_cycle)
    clock.at(COLLECT_EVERY + 5.0, lambda: None)  # the first event past the hour collects
    clock.at(COLLECT_EVERY + 6.0, fail)
    was = gc.isenabled()
    gc.enable()
    try:
        with pytest.raises(RuntimeError, match="an event failed"):
            clock.run(3 * COLLECT_EVERY)
        assert gc.isenabled()
    finally:
        if not was:
            gc.disable()
    assert collected == [10]  # collected at the hour's first event, before its clock moved
