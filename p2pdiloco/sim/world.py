"""The simulated network: peers, the certified chain, committees and their views.

Certification follows the real rules: the round of version v + 1 is driven by the committee
``committee_for`` draws from the certificate of v (its roster and beacon); each member peer
runs the real ``SyncerNode`` (held submissions, carrying them across views, the locked inputs
it lacks) and its ``SyncerRound``; a ``Done`` certifies, and the certificate body is the one
real syncers build (``body_of``: receipts, roster by ``next_roster``), so elections, trust
(``round_trusted``) and beacons are exactly the network's. Signatures are counted by the round,
not made. A member votes to leave its view by ``core.views.leave_view`` (timed out, a silent
leader, a quorum out of reach); the votes (unsigned) reach every node at once, so one real
``ViewState`` pooled over the network moves everyone on once they are a timeout certificate
(more than k − q votes, so dead members do not hold a view). The next view's committee is
``committee_for(view=j)``, locked to the input set of the state the certificates lock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from p2pdiloco.core.learner import LearnerMachine
from p2pdiloco.core.roster import CommitteeInfo, with_roster
from p2pdiloco.core.round import Done, Submission
from p2pdiloco.core.round_types import RoundParams, held_cap
from p2pdiloco.core.syncer_node import SyncerNode
from p2pdiloco.core.trust import round_trusted, trust_progress, trusted_count
from p2pdiloco.core.views import Seat, ViewState
from p2pdiloco.core.weights import plausible_claim
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.certificates import Certificate, assemble, content_digest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.view_change import ViewVote
from p2pdiloco.sim.backend import Merge, Outcome
from p2pdiloco.sim.clock import SMALL, UNREACHABLE_AFTER, Clock, Links
from p2pdiloco.sim.config import Fault, Profile, SimConfig
from p2pdiloco.sim.learner import SimLearner
from p2pdiloco.sim.relay import Relays
from p2pdiloco.sim.syncer import TICK, Member
from p2pdiloco.sync.committee_msgs import body_of
from p2pdiloco.sync.rules import params_of
from p2pdiloco.sync.sending import LATER_TRIES


@dataclass
class Peer:
    profile: Profile
    present: bool = False
    up: bool = False
    epoch: int = 0  # bumped by every crash: events of an earlier life are ignored
    up_since: float = 0.0
    up_seconds: float = 0.0  # time up while present: the hardware the run could use
    learner: SimLearner | None = None


@dataclass(frozen=True)
class CertRecord:
    version: int
    state_hash: str
    view: int
    opened_at: float  # when the round's view 0 opened (the previous certificate)
    certified_at: float
    merged: tuple[str, ...]
    tokens: int  # tokens trained into the merged deltas (carried steps included)
    credited: int  # tokens the certificate credits (claims clipped to H, ADR 0010)
    wrong: bool  # a state no honest syncer computed
    committee: tuple[str, ...]  # the view's members
    signers: tuple[str, ...]
    content: str  # content digest of the certificate body (what real syncers sign)
    nbytes: int = 0  # its wire size, with a signature from each signer


def manifest_for(cfg: SimConfig, genesis: list[str]) -> tuple[str, RunManifest]:
    # A round must stay open longer than a stretch takes (else it closes before most learners
    # send): grace defaults to 1.5 budgets, as a run's creator would set it.
    stretch = cfg.budget or cfg.stretch_steps * cfg.step_seconds
    rules = {"grace": max(60.0, 1.5 * stretch), "linger": 3.0, **cfg.rules}
    creator = Identity.from_seed(hashlib.sha256(f"sim/{cfg.seed}/creator".encode()).digest())
    run_id, manifest, _ = create_manifest(
        creator,
        created_at=0.0,
        name="sim",
        model="gemma-tiny",
        data="embedded",
        seed=cfg.seed,
        inner_steps=cfg.inner_steps,
        committee_size=cfg.committee_size,
        time_budget=cfg.budget,
        compression=cfg.codec,
        outer={"fragments": cfg.fragments},
        inner={"batch_size": cfg.batch_size, "seq_len": cfg.seq_len},
        rules=rules,
        genesis_committee=genesis,
    )
    return run_id, manifest


@dataclass
class World:
    cfg: SimConfig
    merge: Merge
    profiles: list[Profile]
    clock: Clock = field(default_factory=Clock)
    links: Links = field(default_factory=Links)
    peers: dict[int, Peer] = field(default_factory=dict)
    certs: list[CertRecord] = field(default_factory=list)
    subs: dict[str, Submission] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    # counters
    trained_tokens: int = 0
    failed_merges: int = 0
    view_changes: int = 0
    conflicts: int = 0  # two certificates of one version with different states
    fetched_bytes: int = 0
    learner_up: int = 0  # delta bytes learners sent (every copy, retries included)
    relayed: int = 0  # delta bytes members passed on to their fellows (ADR 0028)
    learner_down: int = 0  # certified-update and certificate bytes learners fetched
    cert_bytes: int = 0  # the wire size of the last certificate (its receipts grow with M)
    syncer_in: int = 0  # bytes members received: deltas, fetched inputs, states to sync from
    member_rounds: int = 0  # (member, view) rounds opened
    deltas_sent: int = 0
    lost_in_flight: int = 0  # messages whose sender crashed before they arrived (``sent_by``)

    def __post_init__(self) -> None:
        genesis = [p.peer_id for p in self.profiles[: self.cfg.committee_size]]
        self.run_id, self.manifest = manifest_for(self.cfg, genesis)
        self.merge.bind(self.run_id, self.manifest)
        self.by_id = {p.peer_id: p.index for p in self.profiles}
        self.version = 0
        self.state_hash = self.merge.genesis_hash()
        self.cert: Certificate | None = None  # the last certificate (body real, unsigned)
        self.round_opened = 0.0
        self.view = 0
        # Votes reach every node at once: one ViewState stands for each member's (me: none).
        self.views = ViewState(self.run_id, self.manifest, None, "", 0.0)
        self.members: dict[int, dict[int, Member]] = {}  # view → peer index → member
        self.nodes: dict[int, tuple[int, SyncerNode[int, None]]] = {}  # index → (epoch, node)
        self.trusted = round_trusted(self.manifest, None)  # the round's (core.trust)
        self.progress: dict[str, int] | None = None  # roster credits (RoundParams.progress)
        self.committee = self.views.committee()
        self.seat = self.views.seat()
        self.member_indices = tuple(self.by_id[m] for m in self.committee.members)
        self.prev_agreed: set[int] = set()  # members that computed the last certified state
        self.wrong = hashlib.sha256(b"faulty").hexdigest()
        self._sets: dict[int, frozenset[str]] = {}
        self.relays = Relays(self)

    @property
    def round_key(self) -> tuple[int, int]:
        return self.version, self.view

    # -- peers -------------------------------------------------------------------------------

    def start(self, faults: list[Fault]) -> None:
        for p in self.profiles[: self.cfg.peers]:
            self._arrive(p, fresh_state=False)
        for f in faults:
            self.clock.at(f.time, self._fault, f)
        self._open_view()

    def _arrive(self, profile: Profile, fresh_state: bool) -> None:
        self.links.add(profile)
        peer = self.peers.setdefault(profile.index, Peer(profile))
        peer.present = True
        self._boot(peer, fresh_state)

    def _boot(self, peer: Peer, download: bool) -> None:
        peer.up, peer.up_since = True, self.clock.now
        peer.epoch += 1
        delay = self.cfg.restart_seconds if download else 0.0
        ready = (
            self.links.download(peer.profile.index, self.cfg.state_bytes, self.clock.now + delay)
            if download
            else self.clock.now
        )
        self.clock.at(ready, self._start_learner, peer, peer.epoch)

    def _start_learner(self, peer: Peer, epoch: int) -> None:
        if not (peer.up and peer.epoch == epoch):
            return
        machine = LearnerMachine.for_run(
            self.manifest,
            self.version,
            inner_steps=self.cfg.inner_steps,
            chunk=self.cfg.inner_steps,
        )
        peer.learner = SimLearner(self, peer.profile.index, machine, epoch)
        peer.learner.go()
        old = self.members.get(self.view, {}).get(peer.profile.index)
        if peer.profile.peer_id in self.committee.members and (old is None or not old.alive):
            self._open_member(peer.profile.index)  # back after a crash: a fresh round

    def _fault(self, f: Fault) -> None:
        if f.kind == "join":
            self._arrive(self.profiles[f.peer], fresh_state=True)
            return
        peer = self.peers[f.peer]
        if f.kind == "up" and peer.present and not peer.up:
            self._boot(peer, download=True)
        elif f.kind in ("down", "leave") and peer.present:
            if peer.up:
                peer.up_seconds += self.clock.now - peer.up_since
            if peer.learner is not None:
                peer.learner.poke()  # the chunks it finished count as trained
            peer.up, peer.epoch, peer.learner = False, peer.epoch + 1, None
            peer.present = f.kind != "leave"

    def finish(self) -> None:
        for peer in self.peers.values():
            if peer.learner is not None:
                peer.learner.poke()  # the overtime chunks finished by now count as trained
            if peer.up:
                peer.up_seconds += self.clock.now - peer.up_since
                peer.up_since = self.clock.now

    # -- delivery ----------------------------------------------------------------------------

    def deliver_one(self, learner: SimLearner, sub: Submission, index: int) -> None:
        """An upload the delivery machine asks for (``SimLearner._feed``). The signed header goes
        first; the payload follows only if the syncer has the round open (else it answers
        "later" from the header alone, as ``Intake.screen`` does) and its relays would not
        outlast the round's collecting (else BUSY from the header alone, ``Relayer.screening``).
        A learner on the committee hands its delta to its own syncer: no transfer."""
        if not learner.alive:
            return
        member = self.live_member(index)
        busy = member is not None and self._overrun(member, sub)
        if index == learner.index:
            self.clock.at(self.clock.now, self._arrival, learner, sub, index, busy)
            return
        size = self.cfg.delta_bytes if member is not None and not busy else SMALL
        t = self.links.transfer(learner.index, index, size, self.clock.now)
        if size > SMALL:
            self.learner_up += size
            self.syncer_in += size
        self.clock.at(t, self._arrival, learner, sub, index, busy)

    def _arrival(self, learner: SimLearner, sub: Submission, index: int, busy: bool) -> None:
        member = self.live_member(index)
        code: Reason | None = Reason.NO_OPEN_ROUND  # up, but not in this round yet: "later"
        ok, hint = False, None
        if member is not None and busy:
            code = Reason.BUSY  # its relays would outlast the round's collecting (sync.relay)
        elif member is not None:
            ok, code, hint = member.submit(sub, learner.index)
        elif index not in self.peers or not self.peers[index].up:  # unreachable: the next one
            self.clock.after(UNREACHABLE_AFTER, learner.unreachable, sub.digest, index)
            return
        t = self.links.transfer(index, learner.index, SMALL, self.clock.now)
        if ok:  # straight from its learner: passed on to the other members
            self._relay(sub, learner.index, index)
        p = learner.pending
        if ok and p is not None and p.sub.digest == sub.digest:
            if p.accepted_coming:
                return  # one "accepted" tells the learner; more change nothing (fewer events)
            p.accepted_coming = True
        self.clock.at(t, learner.reply, sub.digest, index, ok, code, hint)

    def _overrun(self, member: Member, sub: Submission) -> bool:
        rnd = member.round
        fresh = rnd.undecided and sub.digest not in rnd.accepted
        return fresh and self.relays.overrun(member.index, rnd.collecting_left(self.clock.now))

    def _relay(self, sub: Submission, learner: int, src: int) -> None:
        self.relays.push(sub, learner, src)

    def later(self, dst: int, tries: int) -> bool:
        """Member ``dst`` would answer "later": it is up, and not in this view's round yet."""
        peer = self.peers.get(dst)
        return peer is not None and peer.up and tries < LATER_TRIES

    def live_member(self, index: int) -> Member | None:
        """Peer ``index``'s member of this view's round, if it is up and in it."""
        view = self.members.get(self.view)
        m = view.get(index) if view is not None else None
        return m if m is not None and m.alive else None

    def dropped(self, peer_id: str, code: Reason, src: int) -> None:
        peer = self.peers.get(self.by_id[peer_id])
        learner = peer.learner if peer is not None else None
        if learner is not None and learner.pending is not None:
            digest = learner.pending.sub.digest
            t = self.links.transfer(src, learner.index, SMALL, self.clock.now)
            self.clock.at(t, learner.dropped, digest, src, code)

    def catch_up(self, learner: SimLearner) -> None:
        size = self.cfg.fragment_update_bytes + self.cert_bytes
        t = self.links.download(learner.index, size, self.clock.now)
        self.learner_down += size
        self.clock.at(t + self.cfg.apply_seconds, learner.cert_arrived, self.version)

    def sent_by(self, src: int, t: float, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` at ``t``, when a transfer from ``src`` ends; lost if ``src`` crashed or
        left before then (its connection broke mid-transfer). For what a sender fires and
        forgets: proposals, signatures, relayed copies."""
        epoch = self.peers[src].epoch
        self.clock.at(t, self._if_sender_lived, src, epoch, fn, args)

    def _if_sender_lived(
        self, src: int, epoch: int, fn: Callable[..., None], args: tuple[Any, ...]
    ) -> None:
        peer = self.peers.get(src)
        if peer is not None and peer.up and peer.epoch == epoch:
            fn(*args)
        else:
            self.lost_in_flight += 1

    def retry_proposal(self, sender: str, digests: tuple[str, ...], attempt: int) -> None:
        member = self.member_by_id(self.view, sender)
        if member is not None:
            for m in self.members_of_view(self.view):
                if m is not member and m.round.attempt != attempt:
                    self.clock.after(TICK, m.proposal, sender, digests, attempt)

    # -- committees --------------------------------------------------------------------------

    def members_of_view(self, view: int) -> list[Member]:
        return [m for m in self.members.get(view, {}).values() if m.alive]

    def member_by_id(self, view: int, peer_id: str) -> Member | None:
        return self.members.get(view, {}).get(self.by_id.get(peer_id, -1))

    def _open_view(self) -> None:
        self.committee = self.views.committee()
        self.member_indices = tuple(self.by_id[m] for m in self.committee.members)
        self.seat = self._seat()
        for peer_id in self.committee.members:
            index = self.by_id[peer_id]
            peer = self.peers.get(index)
            if peer is None or not peer.up:
                continue
            held = index in self.prev_agreed or self.version == 0
            ready = self.clock.now + peer.profile.latency
            if not held:  # it installs the version before it opens the round
                ready = self.links.download(index, self.cfg.state_bytes, ready)
                ready += self.cfg.apply_seconds
                self.syncer_in += self.cfg.state_bytes
            self.clock.at(ready, self._open_member, index, self.round_key, peer.epoch)

    def _seat(self) -> Seat:
        """The view as its members open it. The votes name states, not certificate bodies: the
        lock's input set is that of the state it names; a lock on a state no honest syncer
        computed binds nobody here."""
        seat = self.views.seat()
        out = self.outcomes.get(seat.lock) if seat.lock is not None else None
        if out is None:
            return replace(seat, lock=None, locked=None)
        return replace(seat, locked=tuple(sorted((*out.merged, *out.screened_out))))

    def _node(self, index: int, epoch: int) -> SyncerNode[int, None]:
        """Peer ``index``'s syncer node in its life ``epoch`` (a restart forgets what it held),
        installed on the current version."""
        got = self.nodes.get(index)
        if got is None or got[0] != epoch:
            peer_id = self.peers[index].profile.peer_id
            got = self.nodes[index] = (epoch, SyncerNode(peer_id, self.run_id, self.manifest))
        node = got[1]
        if node.version != self.version:
            node.install(self.cert, self.version, self.clock.now, self.views)
        return node

    def _open_member(
        self, index: int, key: tuple[int, int] | None = None, epoch: int | None = None
    ) -> None:
        peer = self.peers[index]
        if (key is not None and key != self.round_key) or not peer.up:
            return
        if epoch is not None and epoch != peer.epoch:
            return  # it crashed while loading the state: its restart opens the round
        old = self.members.setdefault(self.view, {}).get(index)
        if old is not None and old.alive:
            return
        node = self._node(index, peer.epoch)
        opening = node.open_view(self._params, self.clock.now, self.seat)
        assert node.round is not None  # the view's committee holds it, and the lock is known
        member = Member(
            self,
            index,
            self.view,
            node,
            node.round,
            self.state_hash,
            peer.epoch,
            peer.profile.faulty,
        )
        self.member_rounds += 1
        self.members[self.view][index] = member
        self.clock.after(TICK, member.tick)
        for sub, actions in opening.carried:  # what it held in the views before (SyncerNode)
            member.execute(list(actions), skip_reply_to=sub.peer_id)
        if (fetch := opening.fetch) is not None:  # the locked inputs it lacks, from a voter
            voters = [self.by_id[h] for h in fetch.holders]
            src = next((h for h in voters if self._holds(h)), index)
            subs = [self.subs[d] for d in fetch.digests if d in self.subs]
            t = self.links.transfer(src, index, self.cfg.delta_bytes * len(subs), self.clock.now)
            self.clock.at(t, member.fetched, subs, src)

    def _holds(self, index: int) -> bool:
        """Peer ``index`` is up and in the life whose node signed the lock: it holds the lock's
        inputs (as the runtime asks the lock's voters in turn)."""
        got, peer = self.nodes.get(index), self.peers.get(index)
        return got is not None and peer is not None and peer.up and got[0] == peer.epoch

    def _params(
        self, committee: CommitteeInfo, locked: tuple[str, ...] | None, close_after: float
    ) -> RoundParams:
        """The round's parameters (the simulator keeps the manifest's fixed grace)."""
        live = [p.profile.peer_id for p in self.peers.values() if p.up]
        return params_of(
            self.run_id,
            self.manifest,
            self.version,
            self.trusted,
            committee,
            len(live),
            self.clock.now,
            locked=locked,
            trusted_learners=trusted_count(self.trusted, live),
            progress=self.progress,
            max_inputs=self.cfg.max_inputs or held_cap(self.cfg.delta_bytes),
        )

    def vote(self, member: Member, signed: str | None) -> None:
        """A member votes to leave its view. The votes move everyone on once the pooled
        ``ViewState`` finds them a timeout certificate (the silent members alone could not
        certify, and at most one signed state could have), locked on that state."""
        if member.view != self.view:
            return
        lock = self.views.lock_ref
        vote = ViewVote(self.run_id, self.version + 1, self.view, signed, member.peer_id, "", lock)
        if not self.views.add(vote, self.clock.now):
            return
        self.view_changes += self.views.view - self.view
        self.view = self.views.view
        self._open_view()
        for peer in self.peers.values():
            if peer.learner is not None:
                peer.learner.redeliver()

    # -- certificates ------------------------------------------------------------------------

    def wrong_hash(self, version: int) -> str:
        return hashlib.sha256(f"{self.wrong}/{version}".encode()).hexdigest()

    def certify(self, member: Member, done: Done) -> None:
        if done.version <= self.version:
            if done.version == self.version and done.state_hash != self.state_hash:
                self.conflicts += 1
            return
        out = self.outcomes.get(done.state_hash)
        merged = out.merged if out is not None else ()
        h = self.cfg.inner_steps
        counted = [plausible_claim(self.subs[d].steps, self.subs[d].tokens, h) for d in merged]
        judged = set(merged).union(out.screened_out if out is not None else ())
        senders = {
            d: (self.subs[d].peer_id, self.subs[d].steps, self.subs[d].tokens)
            for d in self.subs
            if d in judged
        }
        body = body_of(
            self.run_id,
            self.manifest,
            self.version,
            self.cert,
            self.committee,
            done.state_hash,
            senders,
            list(merged),
            out.screened_out if out is not None else {},
            self.view,
            out.update_hash if out is not None else None,
            params_hash=out.params_hash if out is not None else None,
        )
        self.cert = with_roster(self.manifest, self.cert, Certificate(body, done.signers, b""))
        self.cert_bytes = len(assemble(body, dict.fromkeys(done.signers, "0" * 128)))
        self.trusted = round_trusted(self.manifest, self.cert)
        self.progress = None if self.trusted is None else trust_progress(self.manifest, self.cert)
        self.certs.append(
            CertRecord(
                done.version,
                done.state_hash,
                self.view,
                self.round_opened,
                self.clock.now,
                merged,
                sum(self.subs[d].tokens for d in merged),
                sum(t for _, t in counted),
                out is None,
                self.committee.members,
                done.signers,
                content_digest(body),
                self.cert_bytes,
            )
        )
        self.prev_agreed = {
            m.index for m in self.members_of_view(self.view) if m.round.last_hash == done.state_hash
        }
        self.version, self.state_hash = done.version, done.state_hash
        self.round_opened, self.view, self.members = self.clock.now, 0, {}
        self.views = ViewState(self.run_id, self.manifest, self.cert, "", self.clock.now)
        self._forget_old_subs()
        self._move_nodes_on()
        for peer in self.peers.values():
            learner = peer.learner
            if learner is not None and learner.alive:
                size = self.cfg.fragment_update_bytes + self.cert_bytes
                t = self.links.download(learner.index, size, self.clock.now + peer.profile.latency)
                self.learner_down += size
                self.clock.at(t, learner.cert_arrived, done.version)
        self._open_view()

    def merged_since(self, version: int, newest: int) -> frozenset[str]:
        """Digests merged by versions ``version`` + 1 … ``newest`` (certs[i] is version i + 1)."""
        sets = [self._merged_set(c) for c in self.certs[version:newest]]
        return sets[0] if len(sets) == 1 else frozenset().union(*sets)

    def _merged_set(self, cert: CertRecord) -> frozenset[str]:
        got = self._sets.get(cert.version)
        if got is None:
            got = self._sets[cert.version] = frozenset(cert.merged)
        return got

    def _move_nodes_on(self) -> None:
        """Every node that has sat learns the new version now, not when it is next seated: what
        it held and saw for older rounds is over (``SyncerNode.install``), so memory is that of
        the live rounds. Lazily, the held copies of every node seated once grew with the run
        (400,000 after 5 simulated minutes at 1,000 peers; gigabytes in the 10,000-peer hour)."""
        for _epoch, node in self.nodes.values():
            node.install(self.cert, self.version, self.clock.now, self.views)

    def _forget_old_subs(self) -> None:
        oldest = self.version - self.manifest.rules.staleness - 1
        if len(self.subs) > 4 * len(self.profiles):
            self.subs = {d: s for d, s in self.subs.items() if s.base_version >= oldest}
