"""Two of this project's gossipsub stacks in one trio run, each link broken as it was seen
broken, then mended: ``python gossip_mend.py`` prints one ``ok <case>`` line per case.

Run as a script (py-libp2p and hivemind never share an interpreter, ADR 0001). Both faults are
made the way they happen, inside py-libp2p's own state, because no peer can cause them on
purpose: (1) a peer forgot our subscriptions (our hello lost), so it holds its publications for
us as for a peer not yet identified; (2) our pubsub stream to a connected peer failed to open
with ``StreamFailure``, which py-libp2p does not retry. Before each mend the message is shown
not to arrive; after :func:`p2pdiloco.net.gossip_host.mend_links`, it arrives.
"""

from __future__ import annotations

import os
from typing import Any

import multiaddr
import trio
from libp2p.host.exceptions import StreamFailure
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.tools.anyio_service import background_trio_service

from p2pdiloco.net.gossip_host import build_pubsub, mend_links

TOPIC = "t"
NOT_DELIVERED_WITHIN = 2.0  # the fault shown: nothing arrives in this long
DELIVERED_WITHIN = 10.0  # after the mend


async def _expect_nothing(sub: Any, case: str, me: ID) -> None:
    """No message from another peer on ``sub`` for a while."""
    with trio.move_on_after(NOT_DELIVERED_WITHIN):
        msg = await sub.get()
        while msg.from_id == me.to_bytes():
            msg = await sub.get()
        raise SystemExit(f"{case}: delivered before the mend: {msg.data!r}")


async def _expect(sub: Any, data: bytes, case: str, me: ID) -> None:
    """The next message on ``sub`` from another peer (py-libp2p hands a host its own
    publications too) is ``data``."""
    with trio.fail_after(DELIVERED_WITHIN):
        msg = await sub.get()
        while msg.from_id == me.to_bytes():
            msg = await sub.get()
    if msg.data != data:
        raise SystemExit(f"{case}: got {msg.data!r}, expected {data!r}")


async def _held_then_mended(
    pa: Any, pb: Any, sub_a: Any, case: str, mended: tuple[int, int]
) -> None:
    """b publishes; a hears nothing until ``mend_links(a)`` (which reports ``mended``: peers
    told, streams reopened), then hears it."""
    a_id = pa.host.get_id()
    data = f"held: {case}".encode()
    await pb.publish(TOPIC, data)
    await _expect_nothing(sub_a, case, a_id)
    assert mend_links(pa) == mended, (case, mended)
    await _expect(sub_a, data, case, a_id)
    print("ok", case, flush=True)


async def main() -> None:
    ha, pa, la = build_pubsub(os.urandom(32), "127.0.0.1", 0)
    hb, pb, lb = build_pubsub(os.urandom(32), "127.0.0.1", 0)
    a_id, b_id = ha.get_id(), hb.get_id()

    # Fault (2) armed: a's pubsub streams to b fail as timed-out negotiations do, until the
    # link is up (py-libp2p tries more than once on a new connection).
    real_new_stream = ha.new_stream
    failed: list[ID] = []
    armed = True

    async def new_stream(peer_id: ID, protocols: Any) -> Any:
        if peer_id == b_id and armed:
            failed.append(peer_id)
            raise StreamFailure(f"failed to open a stream to peer {peer_id}")
        return await real_new_stream(peer_id, protocols)

    ha.new_stream = new_stream

    async with (
        ha.run([la]),
        hb.run([lb]),
        background_trio_service(pa),
        background_trio_service(pa.router),
        background_trio_service(pb),
        background_trio_service(pb.router),
    ):
        await pa.wait_until_ready()
        await pb.wait_until_ready()
        sub_a = await pa.subscribe(TOPIC)
        sub_b = await pb.subscribe(TOPIC)
        addr = multiaddr.Multiaddr(f"{ha.get_addrs()[0]}/p2p/{a_id.to_base58()}")
        await hb.connect(info_from_p2p_addr(addr))

        # (2) b dialled a; a's stream to b failed and was never retried: b never hears
        # a's subscriptions and holds what it publishes.
        await pb.wait_for_peer(a_id, timeout=DELIVERED_WITHIN)
        await trio.sleep(NOT_DELIVERED_WITHIN)
        assert failed and b_id not in pa.peers, "the stream fault did not happen"
        armed = False  # the cause has passed; the link stays broken without a mend
        await _held_then_mended(pa, pb, sub_a, "stream", mended=(0, 1))

        # The link is whole: each has the other in its mesh.
        await pa.wait_for_mesh(b_id, TOPIC, timeout=DELIVERED_WITHIN)
        await pb.wait_for_mesh(a_id, TOPIC, timeout=DELIVERED_WITHIN)
        await pa.publish(TOPIC, b"a to b")
        await _expect(sub_b, b"a to b", "stream", b_id)

        # (1) b does not know a's subscriptions and has a out of its mesh (a's hello was
        # lost): the state of the CI run that failed, where the publisher queued every
        # message for the node "as for a peer not yet identified" for 30 s. a's mend tells
        # its subscriptions again.
        pb._forget_all_subscriptions(a_id)
        pb.router.mesh[TOPIC].discard(a_id)  # type: ignore[attr-defined]
        await _held_then_mended(pa, pb, sub_a, "hello", mended=(1, 0))


if __name__ == "__main__":
    trio.run(main)
