"""Which committee members a learner's delta goes to: one, and the others through it.

A learner uploads each delta once (BRIEF §7b, issue 11): to the first member of the committee
in an order drawn from the delta's digest, so a round's uploads spread evenly over the members.
The member that accepts it from its learner relays the same signed bytes to its fellows
(``sync.relay``). The learner moves on to the next member in that order only when one cannot
be reached or is busy (BUSY: its uplink cannot relay more before the round's input set, ADR
0034, so another member's may; ADR 0046); a member that says "later" (``RETRYABLE``) is asked
again, as are busy ones, one at a time, once every member is busy. A refusal ends it: every
honest member of a view judges a submission alike (late, stale, malformed), and sending the
payload on to the next one only to hear the same cost late deltas up to k uploads (8 learners,
k = 4: 1.6 payloads per delta on average, 4 at most, before this rule).

A member that accepts a delta and then drops it, or refuses it falsely, costs the learner one
round, not its work:
the certificate does not name the delta, so the learner keeps that progress in its next
delta (``LearnerMachine``: not merged → unsent), whose digest draws another member first.
The choice is pure functions, which the runtime drives (``NodeRuntime._deliver``) and the
tests call; ``submit_to`` is the one request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from p2pdiloco.net.sync_rpc import RpcError, RpcRefused
from p2pdiloco.net.transport import Transport
from p2pdiloco.protocol.reasons import Reason

if TYPE_CHECKING:
    from p2pdiloco.runtime.trainer import Submission
    from p2pdiloco.sync.service import SyncService

RELAY = {"relay": True}  # the member that accepts the delta passes it on (``sync.relay``)


def intake_order(digest: str, members: Sequence[str], me: str) -> list[str]:
    """The members in the order this delta tries them: the learner itself first when it is a
    member (its own syncer takes it without an upload), then by SHA-256 of digest and member."""

    def rank(member: str) -> bytes:
        return hashlib.sha256(f"{digest}/{member}".encode()).digest()

    others = sorted((m for m in members if m != me), key=rank)
    return [me, *others] if me in members else others


def fetch_order(digest: str, members: Sequence[str], me: str, proposer: str) -> list[str]:
    """Whom a member asks for agreed input ``digest`` it lacks (ADR 0037): first the fellow its
    learner most likely uploaded it to (the first of :func:`intake_order` for a learner off the
    committee, ``me`` left out: it lacks the input), which relayed it and so holds it, then the
    proposer, which holds every
    input it proposed, then the others as learners try them. The fetches of a round so spread
    over the members' uplinks instead of all queueing on the proposer's."""
    ranked = [m for m in intake_order(digest, members, "") if m != me]
    first = ranked[:1] if ranked and ranked[0] != proposer else []
    return [*first, proposer, *(m for m in ranked if m not in first and m != proposer)]


def next_targets(
    order: Sequence[str], statuses: Mapping[str, str], retry: Sequence[str]
) -> list[str]:
    """Members to send to now (none: done). ``statuses`` holds each asked member's last
    answer ("accepted", "rejected", "busy": BUSY, or "error": unreachable); ``retry`` the
    members to ask again (they said "later" or BUSY, or could not be reached), the one asked
    longest ago first. Done once a member of ``order`` (the current committee) holds the delta
    or refused it, or every member is unreachable and none is left to retry."""
    if any(statuses.get(m) == "accepted" for m in order):
        return []
    if any(statuses.get(m) == "rejected" and m not in retry for m in order):
        return []  # refused by a member of this view: the others would say the same
    waiting = [m for m in retry if m in order]
    if any(statuses.get(m) in ("error", "busy") for m in waiting) or not waiting:
        fresh = [m for m in order if m not in statuses]
        if fresh:  # the next member at once: the one asked cannot be reached, or is busy
            return fresh[:1]
        if waiting and all(statuses.get(m) == "busy" for m in waiting):
            return waiting[:1]  # every member busy: one at a time, never two uploads at once
    return waiting


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
