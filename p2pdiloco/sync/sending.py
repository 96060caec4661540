"""How a committee member sends its fellows a message: retries, and how long "later" is waited.

A fellow that is not in the round yet (it is still loading the state it needs for the view, or
it restarted) answers NO_OPEN_ROUND, "later". A proposal it never gets leaves it silent: it
never merges or signs, and once enough fellows are in that state the view changes, though the
leader and the input set were fine (the simulator found this costing view changes in committees
that had to download the state: ADR 0037). So a message whose sender is still waiting on it
(``later_while``) is sent again on "later", every few seconds, for as long as that holds;
the other retryable answers (BUSY, unreachable) get ``attempts`` tries, as before.

Every try's outcome, an answer or a dial that failed, is told to the member's round
(``Fellows``, ``heard_from``): enough fellows that cannot be reached put the quorum out of reach
and move the view on (ADR 0041).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from functools import partial
from typing import Any

from p2pdiloco.core.round import Phase, SyncerRound
from p2pdiloco.net.sync_rpc import RpcError
from p2pdiloco.protocol.reasons import RETRYABLE, Reason

log = logging.getLogger(__name__)

LATER_EVERY = 2.0  # seconds between sends to a fellow that answered "later"
LATER_TRIES = 300  # at most this many of them (10 minutes: past any view's timeout)

Call = Callable[[str, str, list[bytes]], Awaitable[object]]


async def send_to(
    call: Call,
    peer: str,
    op: str,
    frame: bytes,
    *,
    attempts: int = 4,
    later_while: Callable[[], bool] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    reached: Callable[[str, bool], None] | None = None,
    behind: Callable[[str], None] | None = None,
) -> bool:
    """Send ``frame`` as ``op`` to ``peer`` until it is taken: True, or False once refused for
    good, out of tries, or no longer wanted (``later_while`` false). ``reached(peer, ok)`` hears
    after every try whether the peer answered (taken or refused: True) or could not be reached
    (False), which the round counts toward ``quorum_unreachable`` (ADR 0041). ``behind(peer)``
    hears, once, that the peer has no open round for this message (it may sit in an earlier
    view: the sender catches it up, ``core.views.catch_up``)."""
    tries = later = 0
    told = False
    while True:
        try:
            await call(peer, op, [frame])
            if reached is not None:
                reached(peer, True)
            return True
        except RpcError as e:
            if reached is not None:
                reached(peer, e.refused)  # an answer, or a dial that failed
            if behind is not None and not told and e.refused and e.code is Reason.NO_OPEN_ROUND:
                told = True
                behind(peer)
            if e.refused and e.code not in RETRYABLE:
                log.info("%s to %s refused: %s", op, peer[-8:], e)
                return False
            if later_while is not None and e.refused and e.code is Reason.NO_OPEN_ROUND:
                later += 1
                if later >= LATER_TRIES or not later_while():
                    return False
                delay = LATER_EVERY
            else:
                tries += 1
                log.info("%s to %s failed (attempt %d): %s", op, peer[-8:], tries, e)
                if tries >= attempts:
                    return False
                delay = float(tries)
        await sleep(delay)
        if later_while is not None and not later_while():
            return False


def still_proposing(
    current: Callable[[], SyncerRound | None], rnd: SyncerRound, attempt: int
) -> bool:
    """A leader still wants its proposal for ``attempt`` of ``rnd`` taken: ``rnd`` is still the
    member's round (``current``), in that attempt, and not certified."""
    return current() is rnd and rnd.attempt == attempt and rnd.phase is not Phase.CERTIFIED


def still_signing(current: Callable[[], SyncerRound | None], rnd: SyncerRound | None) -> bool:
    """A member's signature is still wanted: ``rnd`` is its round and not certified here. A
    fellow that answers "later" gets it again until then (once it is certified, the fellows
    get the certificate; before, a fellow still loading the view's state needed it)."""
    return rnd is not None and current() is rnd and rnd.phase is not Phase.CERTIFIED


def heard_from(current: Callable[[], SyncerRound | None], base: int, peer: str, ok: bool) -> None:
    """Tell the member's current round, if it is still one on ``base`` (in whatever view: a
    vote that failed to reach the next view's leader tells that view's round), that ``peer``
    answered (``ok``) or could not be reached: ``send_to``'s ``reached`` for committee
    messages."""
    rnd = current()
    if rnd is not None and rnd.params.version == base:
        rnd.on_reached(peer) if ok else rnd.on_unreachable(peer, time.monotonic())


class Fellows:
    """A member's committee messages to its fellows (``others``), through ``send_to``, each
    answer or failure told to the round current when it comes, if on the same base version
    (``heard_from``)."""

    def __init__(
        self,
        call: Call,
        current: Callable[[], SyncerRound | None],
        others: Callable[[], list[str]],
        behind: Callable[[str], None] | None = None,
    ) -> None:
        self.call, self.current, self.others = call, current, others
        self.behind = behind  # a fellow without an open round for a message (send_to)

    async def send(self, peer: str, op: str, frame: bytes, **how: Any) -> None:
        rnd = self.current()
        reached = partial(heard_from, self.current, rnd.params.version) if rnd else None
        await send_to(self.call, peer, op, frame, reached=reached, behind=self.behind, **how)

    async def to_all(self, op: str, frame: bytes, skip: Collection[str] = (), **how: Any) -> None:
        """``frame`` to every fellow not in ``skip``, at once."""
        peers = [p for p in self.others() if p not in skip]
        await asyncio.gather(*(self.send(p, op, frame, **how) for p in peers))
