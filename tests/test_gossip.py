"""Gossip plane: py-libp2p gossipsub host in a spawned child, driven by GossipProcess."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from p2pdiloco.net.gossip import GossipError, GossipMessage, GossipProcess
from p2pdiloco.net.gossip_limits import MAX_MESSAGE_BYTES

pytestmark = [
    pytest.mark.timeout(120),
    # conftest kills every child after each test, multiprocessing's resource tracker too;
    # the next spawn relaunches it and warns.
    pytest.mark.filterwarnings("ignore:resource_tracker:UserWarning"),
]

TOPIC = "t"


def _start_all(procs: list[GossipProcess]) -> None:
    with ThreadPoolExecutor(len(procs)) as pool:
        for f in [pool.submit(p.start) for p in procs]:
            f.result()


@pytest.fixture
def star() -> Iterator[list[GossipProcess]]:
    """A, B, C with B and C connected to A only (C has no direct link to B)."""
    procs = [GossipProcess(os.urandom(32), topics=[TOPIC]) for _ in range(3)]
    try:
        t0 = time.monotonic()
        _start_all(procs)
        print(f"\nstarted 3 gossip children in {time.monotonic() - t0:.2f} s")
        yield procs
    finally:
        for p in procs:
            p.close()


def _wait_message(
    proc: GossipProcess, match: Callable[[GossipMessage], bool], deadline: float
) -> GossipMessage | None:
    """First received message that ``match``es before ``deadline``; skips others."""
    while (remaining := deadline - time.monotonic()) > 0:
        msg = proc.get(timeout=remaining)
        if msg is not None and match(msg):
            return msg
    return None


def _drain(proc: GossipProcess) -> list[GossipMessage]:
    out = []
    while (msg := proc.get(timeout=0)) is not None:
        out.append(msg)
    return out


def _wait_mesh(
    sender: GossipProcess, receivers: list[GossipProcess], deadline: float, topic: str = TOPIC
) -> int:
    """Publish probes from ``sender`` until every receiver got one; returns the attempts."""
    prefix = f"probe-{sender.peer_id}-".encode()

    def is_probe(m: GossipMessage) -> bool:
        return m.topic == topic and m.data.startswith(prefix)

    attempt = 0
    pending = list(receivers)
    while pending:
        assert time.monotonic() < deadline, "gossip mesh did not form in time"
        attempt += 1
        sender.publish(topic, prefix + str(attempt).encode())
        short = min(deadline, time.monotonic() + 1.0)
        # Any probe of this sender counts (an earlier one may arrive late).
        pending = [r for r in pending if _wait_message(r, is_probe, short) is None]
    return attempt


def _libp2p_peer_id(seed: bytes) -> str:
    code = (
        "import sys; from libp2p.crypto.ed25519 import create_new_key_pair; "
        "from libp2p.peer.id import ID; "
        f"print(ID.from_pubkey(create_new_key_pair(bytes.fromhex('{seed.hex()}')).public_key)"
        ".to_base58())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def test_import_isolation() -> None:
    code = (
        "import sys, p2pdiloco.net.gossip; "
        "print(sorted(m for m in ('libp2p', 'hivemind') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    code = (
        "import sys, p2pdiloco.net.gossip_host; "
        "print('libp2p' in sys.modules, 'hivemind' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True False"


def test_star_gossip(star: list[GossipProcess]) -> None:
    a, b, c = star
    assert len({a.peer_id, b.peer_id, c.peer_id}) == 3
    assert all(m.endswith(f"/p2p/{a.peer_id}") for m in a.maddrs)
    assert all(m.startswith("/ip4/127.0.0.1/tcp/") for m in a.maddrs)

    t0 = time.monotonic()
    assert b.connect(a.maddrs[0])
    assert c.connect(a.maddrs[0])
    t_connected = time.monotonic()
    deadline = t0 + 30.0
    while set(a.peers()) != {b.peer_id, c.peer_id} or b.peers() != [a.peer_id]:
        assert time.monotonic() < deadline, "pubsub streams did not open"
    assert c.peers() == [a.peer_id]  # star: C has no direct link to B
    t_streams = time.monotonic()
    attempts_b = _wait_mesh(b, [a, c], deadline)
    attempts_c = _wait_mesh(c, [a, b], deadline)
    t_mesh = time.monotonic()
    print(
        f"connect {t_connected - t0:.2f} s, pubsub streams {t_streams - t0:.2f} s, "
        f"mesh (B and C reach everyone) {t_mesh - t0:.2f} s "
        f"({attempts_b} + {attempts_c} probe rounds)"
    )

    payload = os.urandom(1000) + b"from-b"
    b.publish(TOPIC, payload)
    for r in (a, c):
        msg = _wait_message(r, lambda m: m.data == payload, time.monotonic() + 10.0)
        assert msg == GossipMessage(TOPIC, payload, b.peer_id)

    payload = b"from-c" + os.urandom(1000)
    c.publish(TOPIC, payload)
    for r in (a, b):
        msg = _wait_message(r, lambda m: m.data == payload, time.monotonic() + 10.0)
        assert msg == GossipMessage(TOPIC, payload, c.peer_id)

    # The largest allowed message goes through; a larger one is refused and the child lives.
    big = os.urandom(MAX_MESSAGE_BYTES)
    b.publish(TOPIC, big)
    msg = _wait_message(a, lambda m: m.data == big, time.monotonic() + 10.0)
    assert msg is not None and msg.from_peer == b.peer_id
    with pytest.raises(GossipError, match="exceeds"):
        b.publish(TOPIC, big + b"!")
    assert b.alive
    assert b.peers() == [a.peer_id]

    # A topic subscribed after start works too (and only subscribers get it).
    a.subscribe("u")
    c.subscribe("u")
    t1 = time.monotonic()
    _wait_mesh(c, [a], t1 + 20.0, topic="u")
    print(f"mesh on a topic subscribed later: {time.monotonic() - t1:.2f} s")
    c.publish("u", b"on-u")
    msg = _wait_message(a, lambda m: m.data == b"on-u", time.monotonic() + 10.0)
    assert msg == GossipMessage("u", b"on-u", c.peer_id)
    assert all(m.topic == TOPIC for m in _drain(b))

    # asyncio flavour; a message taken by a cancelled aget() is put back, not lost.
    async def aget_checks() -> None:
        b.publish(TOPIC, b"async-1")
        msg = await a.aget(10.0)
        assert msg == GossipMessage(TOPIC, b"async-1", b.peer_id)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(a.aget(None), 0.1)
        b.publish(TOPIC, b"async-2")
        msg = await a.aget(10.0)
        assert msg == GossipMessage(TOPIC, b"async-2", b.peer_id)

    asyncio.run(aget_checks())

    # A sender never receives its own messages (C relays nothing back to B either).
    for p in (a, b, c):
        assert all(m.from_peer != p.peer_id for m in _drain(p))


def test_parent_main_with_hivemind(tmp_path: Path) -> None:
    """A parent whose __main__ imports hivemind (like the node) can run the gossip child.

    ``spawn`` would re-run the parent's main script in the child; GossipProcess prevents it.
    """
    script = tmp_path / "node_main.py"
    script.write_text(
        "import os\n"
        "import hivemind  # noqa: F401\n"
        "import sys\n"
        "from p2pdiloco.net.gossip import GossipProcess\n"
        "assert 'libp2p' not in sys.modules\n"
        "if __name__ == '__main__':\n"
        "    with GossipProcess(os.urandom(32), topics=['t']) as g:\n"
        "        print('alive', g.alive)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "alive True"


def test_peer_id_matches_seed() -> None:
    seed = os.urandom(32)
    with GossipProcess(seed) as g:
        peer_id = g.peer_id
    assert peer_id.startswith("12D3KooW")
    assert peer_id == _libp2p_peer_id(seed)
    try:
        from p2pdiloco.protocol.identity import Identity
    except ImportError:
        return
    assert peer_id == Identity.from_seed(seed).peer_id


def test_killed_child_degrades() -> None:
    """Without restarts (test_gossip_resilience covers them), a dead child degrades."""
    g = GossipProcess(os.urandom(32), topics=[TOPIC], restart=False)
    g.start()
    try:
        assert g.alive and g.pid is not None
        os.kill(g.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while g.alive:
            assert time.monotonic() < deadline, "child death not noticed"
            g.get(timeout=0.2)  # returns None at once when the reader sees EOF
        assert g.get(timeout=0.1) is None
        with pytest.raises(GossipError):
            g.publish(TOPIC, b"x")
        with pytest.raises(GossipError):
            g.peers()
        with pytest.raises(GossipError):
            g.subscribe("other")
    finally:
        g.close()
    g.close()  # idempotent
    assert not g.alive


def test_a_child_stopped_with_its_process_group_is_not_reported_or_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ctrl-C or SIGTERM reaches the whole process group: the gossip child ends first, and the
    node closes within a moment. Nothing is logged as gone or restarted (every stopped node
    wrote "gossip child is gone …; restarting it" before)."""
    g = GossipProcess(os.urandom(32), topics=[TOPIC], restart=True)
    g.start()
    try:
        assert g.pid is not None
        os.kill(g.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        while g.alive:
            assert time.monotonic() < deadline, "child death not noticed"
            g.get(timeout=0.2)
    finally:
        g.close()  # the node's own shutdown, within SHUTDOWN_GRACE
    assert g.restarts == 0
    assert "gossip child is gone" not in caplog.text


def test_start_failure_is_reported() -> None:
    g = GossipProcess(os.urandom(32), listen_host="not-an-ip")
    with pytest.raises(GossipError, match="exit code"):
        g.start()
    assert not g.alive
    g.close()


def test_bad_seed() -> None:
    with pytest.raises(ValueError):
        GossipProcess(b"short")
