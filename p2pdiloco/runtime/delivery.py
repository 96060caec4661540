"""One upload of a learner's delta to one committee member: the delivery machine's ``Send``.

Whom a delta goes to, when, and what the trainer hears are the delivery machine's
(``core.delivery``, docs/core/delivery.md); ``NodeRuntime._deliver`` carries them out, and
:func:`submit_to` is the one request, asking the member to relay the delta to its fellows
(``sync.relay``, ADR 0028).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2pdiloco.net.sync_rpc import RpcError, RpcRefused
from p2pdiloco.net.transport import Transport
from p2pdiloco.protocol.reasons import Reason

if TYPE_CHECKING:
    from p2pdiloco.runtime.trainer import Submission
    from p2pdiloco.sync.service import SyncService

RELAY = {"relay": True}  # the member that accepts the delta passes it on (``sync.relay``)


async def submit_to(
    transport: Transport, service: SyncService | None, me: str, peer: str, sub: Submission
) -> tuple[str, Reason | None, int | None]:
    """(status, code, fast-forward hint) of one member's answer, asked to relay; status "error"
    when it could not be reached. ``peer`` may be ``me``: this node's own ``service``."""
    frames = [sub.header, sub.payload]
    try:
        if peer == me:
            assert service is not None
            reply, _ = await service.handle("submit", peer, dict(RELAY), frames)
        else:
            reply, _ = await transport.call(
                peer, "submit", args=dict(RELAY), frames=frames, timeout=120
            )
    except RpcRefused as e:
        return "rejected", e.code, None
    except RpcError as e:
        return ("rejected" if e.refused else "error"), e.code, None
    status = str(reply.get("status", "error"))
    hint = reply.get("fast_forward")
    code = Reason.parse(reply["code"]) if "code" in reply else None
    return status, code, hint if isinstance(hint, int) else None
