"""A syncer's fetch of an agreed input is retried round its holders (issue 10: "nothing retries a
failed fetch"), and the failpoint that injects such failures on real processes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from p2pdiloco import failpoints
from p2pdiloco.net.sync_rpc import RpcError
from p2pdiloco.sync import fetch


class FlakyTransport:
    """Answers ``fetch`` from ``serves`` only, after failing the first ``drops`` calls."""

    def __init__(self, serves: set[str], drops: int) -> None:
        self.serves, self.drops, self.calls = serves, drops, []

    async def call(self, peer: str, op: str, **kw: Any) -> tuple[dict, list[bytes]]:
        self.calls.append(peer)
        if self.drops > 0:
            self.drops -= 1
            raise RpcError(f"stream to {peer} reset")
        if peer not in self.serves:
            raise RpcError("no such submission here", refused=True)
        return {}, [b"header", b"payload"]


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "FETCH_PAUSE_S", 0.001)


def test_a_dropped_stream_costs_a_retry_not_the_input() -> None:
    t = FlakyTransport({"leader"}, drops=2)
    frames = asyncio.run(fetch.fetch_submission(t, "d" * 64, ["leader"], 1 << 20))  # type: ignore[arg-type]
    assert frames == [b"header", b"payload"] and t.calls == ["leader"] * 3


def test_another_holder_serves_what_the_proposer_cannot() -> None:
    t = FlakyTransport({"member2"}, drops=0)
    holders = ["leader", "member1", "member2"]
    frames = asyncio.run(fetch.fetch_submission(t, "d" * 64, holders, 1 << 20))  # type: ignore[arg-type]
    assert frames[1] == b"payload" and t.calls == holders


def test_gives_up_after_its_rounds_naming_every_failure() -> None:
    t = FlakyTransport(set(), drops=0)
    with pytest.raises(RpcError, match=f"after {fetch.FETCH_TRIES} rounds") as e:
        asyncio.run(fetch.fetch_submission(t, "d" * 64, ["a", "b"], 1 << 20))  # type: ignore[arg-type]
    assert len(t.calls) == 2 * fetch.FETCH_TRIES and "no such submission" in str(e.value)


def test_failpoints_count_down_and_ignore_unknown_names(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(failpoints.ENV, "serve_fetch=2, nope=1, serve_fetch")
    monkeypatch.setattr(failpoints, "_counts", None)
    assert [failpoints.hit("serve_fetch") for _ in range(3)] == [True, True, False]
    assert not failpoints.hit("nope")
    assert "ignoring 'nope=1'" in caplog.text and "ignoring 'serve_fetch'" in caplog.text
    monkeypatch.delenv(failpoints.ENV)
    monkeypatch.setattr(failpoints, "_counts", None)
    assert not failpoints.hit("serve_fetch")  # unset: never fails
