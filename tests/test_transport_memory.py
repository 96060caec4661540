"""MemoryTransport: the in-process transport keeps the wire's limits, refusal codes and counts."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from p2pdiloco.net.sync_rpc import Frames, RpcError, RpcRefused, check_request, refusal
from p2pdiloco.net.transport import MemoryHub, MemoryTransport
from p2pdiloco.protocol.reasons import Reason

T = TypeVar("T")

LIMITS = {"echo": [16, 8], "ping": [], "boom": [], "no": [4], "big": []}
REFUSAL_TEXT = "not now: " + "x" * 600


class Server:
    """A handler that records what reached it and answers per op."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any], Frames]] = []

    async def __call__(
        self, op: str, peer: str, control: dict[str, Any], frames: Frames
    ) -> tuple[dict[str, Any], Frames]:
        self.calls.append((op, peer, control, frames))
        if op == "echo":
            return {"seen": control.get("x"), "n": len(frames)}, [f[::-1] for f in frames] + [b"!"]
        if op == "ping":
            return {"pong": True}, []
        if op == "no":
            raise RpcRefused(Reason.STALE, REFUSAL_TEXT)
        if op == "boom":
            raise KeyError("a handler bug")
        if op == "big":
            return {}, [b"z" * 100]
        raise AssertionError(f"op {op} passed the limits check")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def pair(hub: MemoryHub | None = None) -> tuple[MemoryHub, MemoryTransport, Server]:
    """A hub with server "b" serving LIMITS; the caller's transport is "a"."""
    hub = hub or MemoryHub()
    server = Server()
    await hub.transport("b").serve(server, LIMITS)
    return hub, hub.transport("a"), server


# -- a call that goes through ------------------------------------------------------------------


def test_call_reaches_the_handler_and_returns_reply_and_frames() -> None:
    async def go() -> None:
        _, a, server = await pair()
        sent: list[Any] = [b"hello", bytearray(b"ab")]  # a buffer, not only bytes, is copied
        reply, frames = await a.call("b", "echo", args={"x": 7}, frames=sent, reply_limit=64)
        assert reply == {"seen": 7, "n": 2, "ok": True, "frames": 3}
        assert frames == [b"olleh", b"ba", b"!"]
        assert all(type(f) is bytes for f in frames)

        [(op, peer, control, got)] = server.calls
        assert (op, peer) == ("echo", "a")
        assert control == {"x": 7, "op": "echo", "frames": 2}
        assert got == [b"hello", b"ab"]
        assert all(type(f) is bytes for f in got)

    run(go())


def test_args_cannot_override_op_or_frame_count() -> None:
    async def go() -> None:
        _, a, server = await pair()
        await a.call("b", "ping", args={"op": "echo", "frames": 5})
        [(op, _, control, frames)] = server.calls
        assert op == "ping"
        assert control == {"op": "ping", "frames": 0}
        assert frames == []

    run(go())


def test_call_with_no_args_or_frames() -> None:
    async def go() -> None:
        _, a, _ = await pair()
        assert await a.call("b", "ping") == ({"pong": True, "ok": True, "frames": 0}, [])

    run(go())


def test_serve_registers_the_handler_under_the_transports_id() -> None:
    async def go() -> None:
        hub = MemoryHub()
        server = Server()
        await hub.transport("b").serve(server, LIMITS)
        assert hub.handlers["b"] == (server, LIMITS, None)

    run(go())


# -- refusals: answered with a code ------------------------------------------------------------


def test_unknown_op_is_refused() -> None:
    async def go() -> None:
        _, a, server = await pair()
        with pytest.raises(RpcError) as info:
            await a.call("b", "nope")
        assert info.value.refused and info.value.code is Reason.UNKNOWN_OP
        assert server.calls == []

    run(go())


def test_too_many_frames_is_refused_malformed() -> None:
    async def go() -> None:
        hub, a, server = await pair()
        with pytest.raises(RpcError) as info:
            await a.call("b", "echo", frames=[b"1", b"2", b"3"])
        assert info.value.refused and info.value.code is Reason.MALFORMED
        with pytest.raises(RpcError) as info:
            await a.call("b", "ping", frames=[b"1"])
        assert info.value.refused and info.value.code is Reason.MALFORMED
        assert server.calls == []
        assert hub.sent == {} and hub.received == {}  # refused before the bytes are taken

    run(go())


def test_fewer_frames_than_the_limits_list_is_fine() -> None:
    async def go() -> None:
        _, a, server = await pair()
        reply, _ = await a.call("b", "echo", frames=[b"x" * 16])
        assert reply["n"] == 1
        assert server.calls[0][3] == [b"x" * 16]

    run(go())


@pytest.mark.parametrize("frames", [[b"x" * 17], [b"ok", b"y" * 9]])
def test_request_frame_over_its_limit_is_dropped_not_refused(frames: list[bytes]) -> None:
    async def go() -> None:
        hub, a, server = await pair()
        with pytest.raises(RpcError) as info:
            await a.call("b", "echo", frames=frames)
        assert not info.value.refused
        assert server.calls == []
        assert hub.sent == {} and hub.received == {}

    run(go())


def test_handler_refusal_carries_its_code_and_text() -> None:
    async def go() -> None:
        _, a, server = await pair()
        with pytest.raises(RpcError) as info:
            await a.call("b", "no", frames=[b"abcd"])
        assert info.value.refused and info.value.code is Reason.STALE
        assert str(info.value) == REFUSAL_TEXT[:500]  # text capped as on the wire
        assert len(server.calls) == 1

    run(go())


def test_handler_bug_is_refused_as_internal() -> None:
    async def go() -> None:
        _, a, _ = await pair()
        with pytest.raises(RpcError) as info:
            await a.call("b", "boom")
        assert info.value.refused and info.value.code is Reason.INTERNAL
        assert "a handler bug" not in str(info.value)  # the server's internals stay there

    run(go())


def test_reply_frame_over_reply_limit_fails_the_call() -> None:
    async def go() -> None:
        hub, a, server = await pair()
        with pytest.raises(RpcError) as info:
            await a.call("b", "big", reply_limit=99)
        assert not info.value.refused
        assert hub.received.get("a", 0) == 0  # the reply was not delivered
        reply, frames = await a.call("b", "big", reply_limit=100)  # the limit is inclusive
        assert frames == [b"z" * 100]
        assert len(server.calls) == 2

    run(go())


def test_reply_frame_over_reply_limit_is_malformed_as_on_the_wire() -> None:
    async def go() -> None:
        _, a, _ = await pair()
        with pytest.raises(RpcError) as info:
            await a.call("b", "big", reply_limit=99)
        assert info.value.code is Reason.MALFORMED

    run(go())


# -- faults: peer down, unknown, slow ----------------------------------------------------------


def unreachable(err: RpcError) -> None:
    assert not err.refused
    assert err.code is Reason.UNREACHABLE


def test_peer_down_is_unreachable() -> None:
    async def go() -> None:
        hub, a, server = await pair()
        hub.down.add("b")
        with pytest.raises(RpcError) as info:
            await a.call("b", "ping")
        unreachable(info.value)
        assert server.calls == []
        hub.down.discard("b")
        assert (await a.call("b", "ping"))[0]["pong"]  # back up: reachable again

    run(go())


def test_unregistered_peer_is_unreachable() -> None:
    async def go() -> None:
        _, a, _ = await pair()
        with pytest.raises(RpcError) as info:
            await a.call("nobody", "ping")
        unreachable(info.value)

    run(go())


def test_caller_down_reaches_no_one() -> None:
    async def go() -> None:
        hub, a, server = await pair()
        hub.down.add("a")
        with pytest.raises(RpcError) as info:
            await a.call("b", "ping")
        unreachable(info.value)
        assert server.calls == []

    run(go())


def test_peer_going_down_during_the_delay_loses_the_call() -> None:
    async def go() -> None:
        hub, a, server = await pair()
        hub.delay["b"] = 0.05
        task = asyncio.create_task(a.call("b", "ping"))
        await asyncio.sleep(0)  # let the call start and enter its delay
        hub.down.add("b")
        with pytest.raises(RpcError) as info:
            await task
        unreachable(info.value)
        assert server.calls == []

    run(go())


@pytest.mark.parametrize(("caller", "callee"), [(0.03, 0.0), (0.0, 0.03), (0.02, 0.03)])
def test_delay_of_both_ends_adds_to_the_call(caller: float, callee: float) -> None:
    async def go() -> float:
        hub, a, _ = await pair()
        hub.delay.update({"a": caller, "b": callee})
        loop = asyncio.get_running_loop()
        start = loop.time()
        await a.call("b", "ping")
        return loop.time() - start

    assert run(go()) >= caller + callee - 1e-3


def test_timeout_shorter_than_the_delay_fails_the_call() -> None:
    async def go() -> None:
        hub, a, server = await pair()
        hub.delay["b"] = 5.0
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(RpcError) as info:
            await a.call("b", "ping", timeout=0.02)
        assert loop.time() - start < 2.0  # it gave up at the timeout, not after the delay
        unreachable(info.value)
        assert server.calls == []

    run(go())


# -- byte counters -----------------------------------------------------------------------------


def test_hub_counts_request_and_reply_frame_bytes() -> None:
    async def go() -> None:
        hub, a, _ = await pair()
        await a.call("b", "echo", args={"x": "ignored by the count"}, frames=[b"12345", b"678"])
        # request: 5 + 3 bytes a -> b; reply: 5 + 3 + 1 bytes b -> a
        assert hub.sent == {"a": 8, "b": 9}
        assert hub.received == {"b": 8, "a": 9}

        await a.call("b", "ping")
        assert hub.sent == {"a": 8, "b": 9}  # no frames, no bytes

        c = hub.transport("c")
        await c.call("b", "big")
        assert hub.sent == {"a": 8, "b": 109, "c": 0}
        assert hub.received == {"b": 8, "a": 9, "c": 100}

    run(go())


def test_refused_by_handler_counts_the_request_only() -> None:
    async def go() -> None:
        hub, a, _ = await pair()
        with pytest.raises(RpcError):
            await a.call("b", "no", frames=[b"abcd"])
        assert hub.sent == {"a": 4}
        assert hub.received == {"b": 4}

    run(go())


def test_transports_of_one_hub_call_each_other_both_ways() -> None:
    async def go() -> None:
        hub, a, server_b = await pair()
        server_a = Server()
        await a.serve(server_a, LIMITS)
        b = hub.transport("b")
        await b.call("a", "ping")
        await a.call("b", "ping")
        assert [c[1] for c in server_a.calls] == ["b"]
        assert [c[1] for c in server_b.calls] == ["a"]

    run(go())


# -- sync_rpc helpers --------------------------------------------------------------------------


def test_check_request_gives_the_op_and_the_limits_of_the_frames_sent() -> None:
    assert check_request(LIMITS, {"op": "echo", "frames": 2}) == ("echo", [16, 8])
    assert check_request(LIMITS, {"op": "echo", "frames": 1}) == ("echo", [16])
    assert check_request(LIMITS, {"op": "echo"}) == ("echo", [])  # frames defaults to 0
    assert check_request(LIMITS, {"op": "ping", "frames": 0}) == ("ping", [])


@pytest.mark.parametrize(
    "control", [{"op": "nope", "frames": 0}, {"frames": 0}, {"op": 3}, {"op": ["echo"]}]
)
def test_check_request_refuses_an_unknown_op(control: dict[str, Any]) -> None:
    with pytest.raises(RpcRefused) as info:
        check_request(LIMITS, control)
    assert info.value.code is Reason.UNKNOWN_OP


def test_check_request_caps_the_op_name_in_its_text() -> None:
    with pytest.raises(RpcRefused) as info:
        check_request(LIMITS, {"op": "y" * 1000})
    assert len(str(info.value)) < 100


@pytest.mark.parametrize("count", [3, -1, 99, "2", 1.0, None])
def test_check_request_refuses_a_bad_frame_count(count: object) -> None:
    with pytest.raises(RpcRefused) as info:
        check_request(LIMITS, {"op": "echo", "frames": count})
    assert info.value.code is Reason.MALFORMED


def test_refusal_parses_the_peers_code_and_text() -> None:
    err = refusal({"ok": False, "code": "stale", "error": "too old"})
    assert isinstance(err, RpcError)
    assert err.refused and err.code is Reason.STALE
    assert str(err) == "too old"


@pytest.mark.parametrize("code", ["no_such_code", None, 42, ["busy"]])
def test_refusal_with_an_unknown_code_is_malformed(code: object) -> None:
    err = refusal({"ok": False, "code": code, "error": "?"})
    assert err.refused and err.code is Reason.MALFORMED


def test_refusal_defaults_and_caps_its_text() -> None:
    assert str(refusal({"ok": False, "code": "busy"})) == "refused"
    assert len(str(refusal({"ok": False, "code": "busy", "error": "e" * 2000}))) == 500


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_survives_the_wire_value(reason: Reason) -> None:
    assert Reason.parse(reason.value) is reason
    assert refusal({"ok": False, "code": reason.value}).code is reason
