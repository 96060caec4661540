"""Ending tasks for sure, on Python 3.11's ``wait_for`` that can swallow a cancellation."""

from __future__ import annotations

import asyncio
import logging
import sys
from types import SimpleNamespace

import pytest

from p2pdiloco.aio import cancel_and_wait, quiet_stream_gc


async def _swallowed_once() -> asyncio.Task[None]:
    """A loop like the runtime's sender whose ``wait_for`` completes as the cancel lands: on
    3.11 the cancel is lost and the loop goes on."""
    loop = asyncio.get_running_loop()
    first = loop.create_future()

    async def sender() -> None:
        await asyncio.wait_for(first, 10)
        await asyncio.Event().wait()  # the next submission, which never comes

    task = asyncio.create_task(sender(), name="sender")
    await asyncio.sleep(0)
    first.set_result(None)
    task.cancel()
    return task


def test_a_task_whose_cancel_was_swallowed_is_cancelled_again() -> None:
    async def main() -> None:
        task = await _swallowed_once()
        await asyncio.wait_for(cancel_and_wait([task], "test", pause=0.05), 5)
        assert task.cancelled()

    asyncio.run(main())


def test_a_task_that_never_ends_is_logged_not_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    give_up = asyncio.Event()

    async def stubborn() -> None:
        while not give_up.is_set():
            try:
                await give_up.wait()
            except asyncio.CancelledError:
                continue

    async def main() -> None:
        task = asyncio.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        with caplog.at_level(logging.WARNING):
            await asyncio.wait_for(cancel_and_wait([task], "node", pause=0.01, tries=3), 5)
        assert "node: 1 task(s) did not end when cancelled: stubborn" in caplog.text
        assert not task.done()
        give_up.set()
        await asyncio.wait([task], timeout=5)
        assert task.done()

    asyncio.run(main())


def test_a_leaked_stream_writer_collected_late_is_one_debug_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.object))
    quiet_stream_gc()
    quiet_stream_gc()  # once per process: not wrapped twice
    err = AttributeError("'NoneType' object has no attribute '_selector'")
    with caplog.at_level("DEBUG", logger="p2pdiloco.aio"):
        sys.unraisablehook(SimpleNamespace(object=asyncio.StreamWriter.__del__, exc_value=err))
    assert seen == [] and "leaked daemon stream" in caplog.text

    def other_finalizer() -> None: ...

    sys.unraisablehook(SimpleNamespace(object=other_finalizer, exc_value=err))
    assert seen == [other_finalizer]  # everything else still reaches the default hook
