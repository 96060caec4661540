"""Send one raw frame on the gossipsub protocol to a peer: ``python gossip_attacker.py MADDR HEX``.

A bare py-libp2p host, run as a script (py-libp2p and hivemind never share an interpreter,
ADR 0001). It prints ``sent`` once the bytes are written and exits.
"""

from __future__ import annotations

import contextlib
import os
import sys

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11


async def main(maddr: str, payload: bytes) -> None:
    host = new_host(key_pair=create_new_key_pair(os.urandom(32)))
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
        await host.connect(info)
        stream = await host.new_stream(info.peer_id, [PROTOCOL_ID_V11])
        await stream.write(payload)
        # Until the victim resets the stream (StreamEOF/StreamReset here), at most 5 s.
        with trio.move_on_after(5.0), contextlib.suppress(Exception):
            await stream.read(1)
        print("sent", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], bytes.fromhex(sys.argv[2]))
