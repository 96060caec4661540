"""Members' relays in the simulator, as ``sync.relay.Relayer`` sends them (ADR 0034).

The copies a member passes on queue on its uplink in the order they were taken; one not begun
when the member has adopted its round's input set is dropped (the fellows fetch what the
agreed set needs). A member refuses a learner's delta with BUSY while its queued copies would
outlast the round's collecting time. The real relayer measures its uplink; the simulator knows
it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from p2pdiloco.core.round import Submission
from p2pdiloco.protocol.reasons import RETRYABLE
from p2pdiloco.sim.clock import SMALL, Clock, Links
from p2pdiloco.sim.config import PeerState, SimConfig
from p2pdiloco.sim.syncer import Member
from p2pdiloco.sync.sending import LATER_EVERY

RELAY_TRIES = 4  # a relayed copy answered with another retryable code is sent again this often
# Copies that begin within this many seconds of now are sent in one go: an event per copy
# otherwise, most of a 10,000-peer run's events. Whether the round still collects and the
# fellow is in it is then judged up to this much before the copy begins.
AHEAD = 0.05


class Network(Protocol):
    """What the relays need of the simulated network (``sim.world.World`` is it)."""

    cfg: SimConfig
    clock: Clock
    links: Links
    relayed: int
    syncer_in: int

    @property
    def peers(self) -> Mapping[int, PeerState]: ...
    @property
    def round_key(self) -> tuple[int, int]: ...
    @property
    def member_indices(self) -> tuple[int, ...]: ...
    def live_member(self, index: int) -> Member | None: ...
    def later(self, dst: int, tries: int) -> bool: ...
    def sent_by(self, src: int, t: float, fn: Callable[..., None], *args: Any) -> None: ...


@dataclass
class Relays:
    world: Network
    queues: dict[int, deque[tuple[tuple[int, int], Submission, int, int]]] = field(
        default_factory=dict
    )
    pumping: set[int] = field(default_factory=set)
    dropped: int = 0  # copies not begun before their round's input set was adopted
    busy: int = 0  # learners' deltas refused with BUSY

    def push(self, sub: Submission, learner: int, src: int) -> None:
        """Queue copies of ``sub`` (from ``learner``, taken by member ``src``) to the others."""
        w = self.world
        q, key = self.queues.setdefault(src, deque()), w.round_key
        q.extend([(key, sub, learner, dst) for dst in w.member_indices if dst != src])
        if src not in self.pumping:
            self.pumping.add(src)
            self._pump(src)

    def backlog_s(self, src: int) -> float:
        """Seconds member ``src``'s uplink needs for what is queued and under way."""
        w = self.world
        link = w.links.by_index[src]
        queued = len(self.queues.get(src, ())) * w.cfg.delta_bytes / link.profile.up_bps
        return queued + max(0.0, link.up_free - w.clock.now)

    def overrun(self, src: int, left: float) -> bool:
        """Member ``src`` answers BUSY: its copies would outlast the ``left`` collecting time."""
        busy = self.backlog_s(src) > left
        self.busy += busy
        return busy

    def _pump(self, src: int) -> None:
        w, q = self.world, self.queues[src]
        # Nothing else happens while this runs: the round and its members are as they are.
        now_key, member = w.round_key, w.live_member(src)
        relaying = member is not None
        undecided = member is not None and member.round.undecided
        live: dict[int, bool] = {}
        link, delta_bytes = w.links.by_index[src], w.cfg.delta_bytes
        while q:
            key, sub, learner, dst = q.popleft()
            if key != now_key or not relaying:
                continue
            if not undecided:
                self.dropped += 1  # agreed before this copy began: fetched if in the set
                continue
            # A fellow down, or not in the round yet, takes no payload: the dial fails, or it
            # answers "later" from the header (sync.relay); the payload goes once it is in.
            if (there := live.get(dst)) is None:
                there = live[dst] = w.live_member(dst) is not None
            size = delta_bytes if there else SMALL
            t = w.links.transfer(src, dst, size, w.clock.now)
            if size > SMALL:
                w.relayed += size
                w.syncer_in += size
            w.sent_by(src, t, self.arrived, sub, learner, src, dst, 0, size > SMALL)
            free = link.up_free
            if free > w.clock.now + AHEAD:
                w.clock.at(free, self._pump, src)
                return
        self.pumping.discard(src)

    def arrived(
        self, sub: Submission, learner: int, src: int, dst: int, tries: int, payload: bool = True
    ) -> None:
        """A copy from member ``src`` reached fellow ``dst`` (its header alone unless
        ``payload``). One not in the round yet answers "later": asked again while ``src``
        collects (``sync.relay``, ADR 0037). One down fails the dial, which ``src``'s round
        hears (ADR 0038); it fetches the delta if a proposal names it."""
        w = self.world
        member = w.live_member(dst)
        if member is not None and not payload:  # in since the header left
            self.again(sub, learner, src, dst, tries)
            return
        if member is None:
            relaying = w.live_member(src)
            if w.later(dst, tries) and relaying is not None and relaying.round.undecided:
                w.clock.after(LATER_EVERY, self.again, sub, learner, src, dst, tries + 1)
            elif relaying is not None and not w.peers[dst].up:  # the dial failed
                relaying.round.on_unreachable(w.peers[dst].profile.peer_id, w.clock.now)
            return
        ok, code, _ = member.submit(sub, learner)
        if not ok and code in RETRYABLE and tries < RELAY_TRIES:
            w.clock.after(0.5 * (tries + 1), self.arrived, sub, learner, src, dst, tries + 1)

    def again(self, sub: Submission, learner: int, src: int, dst: int, tries: int) -> None:
        """The payload goes once the fellow is in the round (the header alone before)."""
        w = self.world
        if not w.live_member(dst) is not None:  # still "later": the header alone went
            self.arrived(sub, learner, src, dst, tries)
            return
        t = w.links.transfer(src, dst, w.cfg.delta_bytes, w.clock.now)
        w.relayed += w.cfg.delta_bytes
        w.syncer_in += w.cfg.delta_bytes
        w.sent_by(src, t, self.arrived, sub, learner, src, dst, tries)
