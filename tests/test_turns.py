"""The slow-test turns of tests/turns.py hand over in order: neither worker waits twice."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.netutil import wait_for
from tests.turns import Turns


def test_a_waiting_worker_goes_before_the_one_that_just_had_a_turn(tmp_path: Path) -> None:
    lock = tmp_path / "slow.lock"
    a, b = Turns(lock, "gw0"), Turns(lock, "gw1")
    order: list[str] = []
    b_waiting, b_done = threading.Event(), threading.Event()

    def worker_b() -> None:
        b_waiting.set()
        with b.turn():
            order.append("b")
        b_done.set()

    with a.turn():
        order.append("a1")
        threading.Thread(target=worker_b, daemon=True).start()
        assert b_waiting.wait(10)
        marker = lock.with_name(f"{lock.name}.wait-gw1")
        wait_for("gw1 to wait for its turn", marker.exists, 10, interval=0.01)
    with a.turn():  # b's marker is there: a lets b go first
        order.append("a2")
    assert b_done.wait(10)
    assert order == ["a1", "b", "a2"]
    assert not list(tmp_path.glob("*.wait-*"))
