"""Python 3.11 logs a stream server's connection task cancelled at shutdown as "Exception in
callback ... Traceback" (hivemind's daemon bindings serve inbound streams that way); a stopped
node's log must hold no traceback (a fresh-clone CI failed on one)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from p2pdiloco.aio import quiet_cancelled_stream_callbacks


def serve_and_cancel(path: Path) -> None:
    async def main() -> None:
        started = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            started.set()
            await reader.readexactly(1)  # the client never writes: cancelled while it waits

        server = await asyncio.start_unix_server(handler, path=str(path))
        _, writer = await asyncio.open_unix_connection(str(path))
        await started.wait()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # the tasks' done-callbacks run on the next iteration
        writer.close()
        server.close()

    asyncio.run(main())


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 checks task.cancelled() first")
def test_a_cancelled_stream_handler_leaves_no_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("asyncio")
    saved = list(logger.filters)
    try:
        for f in saved:
            logger.removeFilter(f)
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            serve_and_cancel(tmp_path / "a.sock")
        assert any("Exception in callback" in r.getMessage() for r in caplog.records)
        caplog.clear()
        quiet_cancelled_stream_callbacks()
        quiet_cancelled_stream_callbacks()  # once per process
        assert len(logger.filters) == 1
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            serve_and_cancel(tmp_path / "b.sock")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        for f in list(logger.filters):
            logger.removeFilter(f)
        for f in saved:
            logger.addFilter(f)
