"""A member passes a learner's delta on to its fellow members: the learner uploads it once.

A learner sends each delta to one member and asks it to relay (``runtime.delivery``). The
member that accepts a submission straight from its signer, so asked, sends the same signed
bytes to every other member of the committee, each of which checks it like any submission:
the signature is the learner's, so a relaying member can neither alter a delta nor make one up.
A relayed copy is never relayed again (it does not come from its signer). Members answering
"later" (``RETRYABLE``) are asked again while the round is open; a member that cannot be
reached gets the delta from a fellow's proposal instead (``fetch``), as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from p2pdiloco.net.sync_rpc import RpcError
from p2pdiloco.protocol.reasons import RETRYABLE, Reason
from p2pdiloco.runtime.transport import Transport

log = logging.getLogger(__name__)

ATTEMPTS = 4


async def relay(
    transport: Transport,
    peers: Sequence[str],
    raw: bytes,
    payload: bytes,
    still_open: Callable[[], bool],
) -> int:
    """Send one accepted submission to ``peers``; how many hold it afterwards."""

    async def one(peer: str) -> bool:
        for attempt in range(ATTEMPTS):
            try:
                reply, _ = await transport.call(peer, "submit", frames=[raw, payload], timeout=120)
                code = Reason.parse(reply["code"]) if "code" in reply else None
                if reply.get("status") == "accepted":
                    return True
            except RpcError as e:
                code = e.code if e.refused else Reason.UNREACHABLE
            if code not in RETRYABLE or not still_open():
                log.info("relay to %s: %s", peer[-8:], code)
                return False
            await asyncio.sleep(0.5 * (attempt + 1))
        return False

    return sum(await asyncio.gather(*(one(p) for p in peers)))
