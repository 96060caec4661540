"""One committee member's round in the simulator: the peer's real ``SyncerNode`` and its
``SyncerRound`` (``core/``), and what their effects cost in simulated time (messages over
links, fetches, the merge). The rules are the core's; this module only schedules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from p2pdiloco.core.delivery import fetch_order
from p2pdiloco.core.round import (
    Action,
    Aggregate,
    Done,
    Fetch,
    Phase,
    Propose,
    Reject,
    Sign,
    Submission,
    SyncerRound,
)
from p2pdiloco.core.syncer_node import SyncerNode
from p2pdiloco.core.views import ViewState, leave_view
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.sim.backend import MergeFailed, Outcome
from p2pdiloco.sim.clock import SMALL, UNREACHABLE_AFTER, Links
from p2pdiloco.sim.network import SimNetwork
from p2pdiloco.sync.sending import LATER_EVERY, LATER_TRIES

TICK = 1.0  # seconds between a member's timer events (grace, linger, leader silence, view)


class Network(SimNetwork, Protocol):
    """What a member needs of the simulated network (``sim.world.World`` is it): the clock,
    the links, the peers, the certified chain and its views, and where a member's messages go."""

    links: Links
    outcomes: dict[str, Outcome]  # merged state → what went into it
    failed_merges: int
    fetched_bytes: int
    syncer_in: int

    @property
    def view(self) -> int: ...
    @property
    def views(self) -> ViewState: ...
    def live_member(self, index: int) -> Member | None: ...
    def member_by_id(self, view: int, peer_id: str) -> Member | None: ...
    def later(self, dst: int, tries: int) -> bool: ...
    def sent_by(self, src: int, t: float, fn: Callable[..., None], *args: Any) -> None: ...
    def dropped(self, peer_id: str, code: Reason, src: int) -> None: ...
    def retry_proposal(self, sender: str, digests: tuple[str, ...], attempt: int) -> None: ...
    def vote(self, member: Member, signed: str | None) -> None: ...
    def certify(self, member: Member, done: Done) -> None: ...
    def wrong_hash(self, version: int) -> str: ...


@dataclass
class Member:
    """Peer ``index`` on the committee of ``view`` of the round after version ``base``."""

    world: Network
    index: int
    view: int
    node: SyncerNode[int, None]  # the peer's, in this life; holds who sent each held delta
    round: SyncerRound  # the node's round of this view
    base_hash: str
    epoch: int  # the peer's life when the round opened: a crash ends the member
    faulty: bool
    votes_cast: bool = False
    merging: bool = False

    @property
    def peer_id(self) -> str:
        return self.round.me

    @property
    def alive(self) -> bool:
        w = self.world
        peer = w.peers[self.index]
        return (
            peer.up
            and peer.epoch == self.epoch
            and w.view == self.view
            and w.version == self.round.params.version
        )

    # -- inputs ----------------------------------------------------------------------------

    def submit(self, sub: Submission, sender: int) -> tuple[bool, Reason | None, int | None]:
        """A learner's submission arrived from peer ``sender``: (accepted, code, fast-forward
        hint), as the node judges it (``SyncerNode.on_submission``)."""
        verdict, actions = self.node.on_submission(sub, sender, self.world.clock.now)
        self.execute(actions, skip_reply_to=sub.peer_id)
        return verdict.accepted, verdict.code, verdict.fast_forward

    def proposal(
        self, sender: str, digests: tuple[str, ...], attempt: int, via: str | None = None
    ) -> None:
        """The leader ``sender``'s proposal, from it or passed on by fellow ``via``."""
        if self.alive:
            w = self.world
            version = self.round.params.version + 1
            refusal, actions, adopted = self.node.on_proposal(
                sender, version, self.view, digests, attempt, w.clock.now
            )
            if refusal is not None and refusal[0] is Reason.NO_OPEN_ROUND:
                w.retry_proposal(sender, digests, attempt)
            self.execute([a for a in actions if not isinstance(a, Reject)])
            if adopted:  # pass it on (ADR 0042)
                skip = {sender} if via is None else {sender, via}
                args = (sender, digests, attempt, self.peer_id)
                self.to_fellows("proposal", args, skip, lambda: False)  # once: the leader retries

    def fetched(self, subs: list[Submission], src: int) -> None:
        if self.alive:
            for sub in subs:
                self.execute(self.node.on_fetched(sub, src))

    def signature(self, syncer: str, state_hash: str) -> None:
        if self.alive:
            self.execute(self.node.track(self.round.on_signature(syncer, state_hash)))

    def unreachable(self, peer_id: str) -> None:
        if self.alive:
            self.round.on_unreachable(peer_id, self.world.clock.now)

    def tick(self) -> None:
        if not self.alive or self.round.phase is Phase.CERTIFIED:
            return
        w, now = self.world, self.world.clock.now
        self.execute(self.node.track(self.round.on_tick(now)))
        vote = leave_view(w.views, self.round, now, self.peer_id, self.votes_cast)
        if vote is not None:
            self.votes_cast = True
            w.vote(self, vote.signed)
        w.clock.after(TICK, self.tick)

    # -- actions ---------------------------------------------------------------------------

    def execute(self, actions: list[Action], skip_reply_to: str | None = None) -> None:
        w = self.world
        for a in actions:
            if isinstance(a, Reject):
                if a.peer_id != skip_reply_to and a.code in (
                    Reason.SCREENED_OUT,
                    Reason.MERGE_FAILED,
                    Reason.BUSY,
                ):
                    w.dropped(a.peer_id, a.code, self.index)
            elif isinstance(a, Propose):  # again on "later" while this attempt lasts (ADR 0037)
                same = partial(_in_attempt, self.round, a.attempt)
                self.to_fellows("proposal", (self.peer_id, a.digests, a.attempt), set(), same)
            elif isinstance(a, Fetch):
                self._fetch(a)
            elif isinstance(a, Aggregate):
                self.merging = True
                cost = w.cfg.merge_seconds * len(a.digests)
                w.clock.after(cost, self._merged, a)
            elif isinstance(a, Sign):  # again on "later" while uncertified (ADR 0041)
                self.to_fellows(
                    "signature",
                    (self.peer_id, a.state_hash),
                    set(),
                    lambda: self.round.phase is not Phase.CERTIFIED,
                )
            elif isinstance(a, Done):
                w.certify(self, a)

    def to_fellows(
        self,
        handler: str,
        args: tuple[Any, ...],
        sent: set[str],
        wanted: Callable[[], bool],
        tries: int = 0,
    ) -> None:
        """A small message to each fellow in the round not in ``sent`` (its Member's
        ``handler`` with ``args``), as ``sync.sending.Fellows`` sends one: a fellow not in the
        round yet ("later") gets it every ``LATER_EVERY`` s while ``wanted()``; one down or
        gone fails the dial, which this round hears (ADR 0041)."""
        w = self.world
        if not self.alive or tries >= LATER_TRIES or (tries and not wanted()):
            return
        waiting = False
        for peer_id in w.committee.members:
            if peer_id == self.peer_id or peer_id in sent:
                continue
            dst = w.by_id[peer_id]
            if (m := w.live_member(dst)) is not None:
                sent.add(peer_id)
                t = w.links.transfer(self.index, dst, SMALL, w.clock.now)
                w.sent_by(self.index, t, getattr(m, handler), *args)
            elif w.later(dst, tries):
                waiting = True
            elif not tries:
                w.clock.after(UNREACHABLE_AFTER, self.unreachable, peer_id)
        if waiting and wanted():
            w.clock.after(LATER_EVERY, self.to_fellows, handler, args, sent, wanted, tries + 1)

    def _fetch(self, fetch: Fetch) -> None:
        """Each input from the first member of ``fetch_order`` that holds it (as the service
        asks them in turn), one transfer per holder."""
        w = self.world
        by_src: dict[int, list[Submission]] = {}
        for d in fetch.digests:
            if d not in w.subs:
                continue
            src = self.index
            for peer_id in fetch_order(d, w.committee.members, self.peer_id, fetch.from_peer):
                holder = w.member_by_id(self.view, peer_id)
                if holder is not None and holder.alive and d in holder.round.accepted:
                    src = holder.index
                    break
            by_src.setdefault(src, []).append(w.subs[d])
        for src, subs in by_src.items():
            t = w.links.transfer(src, self.index, w.cfg.delta_bytes * len(subs), w.clock.now)
            w.fetched_bytes += w.cfg.delta_bytes * len(subs)
            w.syncer_in += w.cfg.delta_bytes * len(subs)
            w.clock.at(t, self.fetched, subs, src)

    def _merged(self, agg: Aggregate) -> None:
        self.merging = False
        if not self.alive:
            return
        w, now = self.world, self.world.clock.now
        subs = {d: w.subs[d] for d in agg.digests}
        try:
            out = w.merge.merge(self.base_hash, agg, subs)
        except MergeFailed as e:
            w.failed_merges += 1
            self.execute(
                self.node.track(self.round.on_merge_failed(now, agg.attempt, e.screened_out))
            )
            return
        w.outcomes[out.state_hash] = out
        state_hash = out.state_hash
        if self.faulty:  # colluding faulty syncers all sign the same wrong state
            state_hash = w.wrong_hash(self.round.params.version)
        self.execute(self.node.track(self.round.on_aggregated(state_hash, agg.attempt)))


def _in_attempt(rnd: SyncerRound, attempt: int) -> bool:
    """A leader still wants its proposal taken (``sync.sending.still_proposing``)."""
    return rnd.attempt == attempt and rnd.phase is not Phase.CERTIFIED
