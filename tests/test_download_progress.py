"""A state download shows its bytes and rate (issue 15 item 5): in the phase, and in the log."""

from __future__ import annotations

import logging

import pytest

from p2pdiloco.runtime.status import Tally


def test_download_progress_shows_bytes_and_rate(caplog: pytest.LogCaptureFixture) -> None:
    tally = Tally()
    with caplog.at_level(logging.INFO, logger="p2pdiloco.runtime"):
        tally.download_progress(7, 2_000_000, 8_000_000, 1.0)
        assert tally.phase == "downloading v7 2.0/8.0 MB"
        tally.download_progress(7, 4_000_000, 8_000_000, 2.0)  # within 2 s: no second line
        tally.download_progress(7, 8_000_000, 8_000_000, 4.0)  # done: always logged
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "downloading the state of version 7: 2.0 of 8.0 MB at 2.0 MB/s",
        "downloading the state of version 7: 8.0 of 8.0 MB at 2.0 MB/s",
    ]
