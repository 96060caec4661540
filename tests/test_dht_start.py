"""A DHT process that never says it is ready is ended and started afresh, then refused in one
line: a start never hangs for good (a fresh-clone CI saw every in-process DHT start of one
long-lived test worker hang until the test's timeout)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import psutil
import pytest

from p2pdiloco.net import dht as dht_mod
from p2pdiloco.net.dht import DHTPlane, NetworkError
from p2pdiloco.protocol.identity import Identity

pytestmark = pytest.mark.timeout(120)


def hang_first(flag: Path, always: bool = False):  # noqa: ANN201  (a replacement run())
    real = dht_mod._GuardedDHT.run

    def run(self: dht_mod._GuardedDHT) -> None:
        if always or not flag.exists():
            flag.touch()
            threading.Event().wait()  # a start that never reports ready (ended by the parent)
        real(self)

    return run


def test_a_hung_start_is_ended_and_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(dht_mod, "START_TIMEOUT", 3.0)
    monkeypatch.setattr(dht_mod._GuardedDHT, "run", hang_first(tmp_path / "hung"))
    with caplog.at_level(logging.WARNING, logger="p2pdiloco.net.dht"):
        plane = DHTPlane(Identity.generate(), host="127.0.0.1")
    try:
        assert (tmp_path / "hung").exists()
        assert any("did not start within 3 s" in r.message for r in caplog.records)
        assert plane.peer_id
    finally:
        plane.close()


def test_a_start_that_always_hangs_fails_in_one_line_and_leaves_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dht_mod, "START_TIMEOUT", 2.0)
    monkeypatch.setattr(dht_mod._GuardedDHT, "run", hang_first(tmp_path / "hung", always=True))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(NetworkError, match="did not start within 2 s") as info:
        DHTPlane(Identity.generate(), host="127.0.0.1")
    assert "\n" not in str(info.value)
    left = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before
        and p.name() not in ("torch_shm_manager", "torch_shm_manag")
        and "resource_tracker" not in " ".join(p.cmdline())
        and "lifeline" not in " ".join(p.cmdline())
    ]
    assert not left, left


def test_a_lock_left_held_by_a_killed_process_does_not_hang_the_next_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """hivemind's MPFuture update lock is shared by every process forked after import; one
    SIGKILLed while holding it made every later DHT process of this process block before it
    said it was ready (py-spy on a hung child in CI: ``_send_update`` in ``SemLock.__enter__``)."""
    import multiprocessing as mp
    import os
    import signal

    from hivemind.utils.mpfuture import MPFuture

    monkeypatch.setattr(MPFuture, "_update_lock", mp.Lock())  # this test's, poisoned below
    held = mp.get_context("fork").Event()

    def hold() -> None:
        MPFuture._update_lock.acquire()
        held.set()
        signal.pause()

    child = mp.get_context("fork").Process(target=hold)
    child.start()
    assert held.wait(30)
    os.kill(child.pid, signal.SIGKILL)  # killed holding it: nobody will release it
    child.join(10)
    monkeypatch.setattr(dht_mod, "START_TIMEOUT", 20.0)
    with caplog.at_level(logging.WARNING, logger="p2pdiloco.net.dht"):
        plane = DHTPlane(Identity.generate(), host="127.0.0.1")
    plane.close()
    assert any("_update_lock was held" in r.message for r in caplog.records)
    assert not any("did not start within" in r.message for r in caplog.records)
