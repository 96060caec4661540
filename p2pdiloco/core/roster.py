"""Who may sit on the next committee, from certified data only.

Every node must compute the same committee, so the candidate set cannot come from what each node
happens to see (heartbeats differ between nodes and can be faked). It comes from the roster
of the last certificate, which a quorum signed: each certificate carries the hash of
``next_roster(previous roster, its own receipts)``, and every node derives the list itself as it
verifies the chain (:func:`verify_successor` attaches it to the certificate, ADR 0044), so a
certificate's size does not grow with the roster. Before the first certificate, the manifest's
genesis committee (or the run creator alone) is the roster.

A peer stays on the roster for the manifest's ``rules.roster_window`` versions after its last
accepted delta, so the roster follows the learners actually contributing; its counters
(accepted deltas, tokens) are the eligibility and weight of :func:`p2pdiloco.core.committee.elect`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from p2pdiloco.core import committee
from p2pdiloco.protocol.certificates import (
    Accepted,
    Certificate,
    RosterEntry,
    content_digest,
    content_json,
    roster_digest,
)
from p2pdiloco.protocol.records import RunManifest, SyncRules
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.protocol.view_change import MAX_VIEW, TimeoutCert, tc_lock

__all__ = [
    "MAX_ROSTER",
    "ROSTER_WINDOW",
    "CommitteeInfo",
    "beacon_of",
    "committee_for",
    "committee_of_roster",
    "genesis_roster",
    "next_roster",
    "roster_after",
    "roster_of",
    "verify_successor",
    "with_roster",
]

# Identities kept on a roster. Every node holds the roster of its newest certificate in memory
# (about 0.5 KB an entry) and elects over it each round; ADR 0044 measures both at this size.
MAX_ROSTER = 65_536
# Versions a peer stays on the roster after its last accepted delta: the manifest's default.
ROSTER_WINDOW: int = SyncRules.model_fields["roster_window"].default
_MAX_COUNT = 2**63 - 1  # RosterEntry's bound: counters saturate instead of failing validation


def genesis_roster(manifest: RunManifest) -> list[RosterEntry]:
    """The roster before any certificate: the genesis committee, or the creator alone."""
    members = manifest.genesis_committee or [manifest.creator]
    return [
        RosterEntry(peer_id=p, joined_version=0, accepted=0, tokens=0, last_version=0)
        for p in sorted(members)
    ]


def next_roster(
    prev: Sequence[RosterEntry],
    *,
    new_version: int,
    accepted: Sequence[Accepted],
    window: int = ROSTER_WINDOW,
) -> list[RosterEntry]:
    """The roster to certify with ``new_version``, given the previous one and its receipts.

    Each receipt adds one accepted delta and its tokens to its peer and sets ``last_version`` to
    ``new_version`` (a merged delta credited nothing, ``Accepted.credited``, is no receipt); a peer new to the roster joins at ``new_version - 1`` (the base it trained
    from). Entries idle for more than ``window`` versions (measured from the later of
    ``last_version`` and ``joined_version``) are dropped; beyond MAX_ROSTER, the most recently
    active, then heaviest, then lowest peer ids stay. Sorted by peer id. Pure: every syncer
    computes the same list. Raises ValueError if ``new_version < 1``, ``window < 0`` or ``prev``
    repeats a peer.
    """
    if new_version < 1:
        raise ValueError("new_version must be at least 1")
    if window < 0:
        raise ValueError("window must be non-negative")
    entries = {e.peer_id: e for e in prev}
    if len(entries) != len(prev):
        raise ValueError("previous roster repeats a peer")
    # (joined, accepted, tokens) of each peer with a receipt, in first-receipt order: one
    # entry made per peer, not a copy per receipt (a pydantic copy each made a 10,000-receipt
    # certificate cost a syncer, and the simulator, a quarter of a second).
    counts: dict[str, tuple[int, int, int]] = {}
    for a in accepted:
        if not a.credited:
            continue
        got = counts.get(a.peer_id)
        if got is None:
            e = entries.get(a.peer_id)
            got = (e.joined_version, e.accepted, e.tokens) if e else (new_version - 1, 0, 0)
        joined, n, tokens = got
        counts[a.peer_id] = (joined, min(n + 1, _MAX_COUNT), min(tokens + a.tokens, _MAX_COUNT))
    for peer, (joined, n, tokens) in counts.items():
        entries[peer] = RosterEntry(
            peer_id=peer, joined_version=joined, accepted=n, tokens=tokens, last_version=new_version
        )
    kept = [
        e for e in entries.values() if new_version - max(e.last_version, e.joined_version) <= window
    ]
    if len(kept) > MAX_ROSTER:
        kept.sort(key=lambda e: (-e.last_version, -e.tokens, e.peer_id))
        kept = kept[:MAX_ROSTER]
    return sorted(kept, key=lambda e: e.peer_id)


@dataclass(frozen=True)
class CommitteeInfo:
    """The committee of one round, as every node computes it."""

    version: int  # the version this round produces (base + 1)
    members: tuple[str, ...]  # elected syncers, best score first (index 0 is the first leader)
    quorum: int  # matching signatures that certify ``version``
    view: int = 0  # which view of ``version`` this committee sits in


def roster_of(manifest: RunManifest, cert: Certificate | None) -> list[RosterEntry]:
    """The candidates of the election after ``cert``: its roster, or the genesis roster.

    A certified but empty roster (every peer idle past the window) also falls back to the
    genesis roster, so a run that stalled can be restarted by its genesis committee rather than
    being left with no committee at all. Raises ValueError for a certificate whose roster was
    never derived (only parsed, not verified against the chain: a caller bug).
    """
    if cert is None:
        return genesis_roster(manifest)
    if cert.roster is None:
        raise ValueError(
            f"the roster of version {cert.body.version} is unknown: verify its certificate "
            "against the chain first (core.roster.verify_successor)"
        )
    return list(cert.roster) or genesis_roster(manifest)


def roster_after(
    manifest: RunManifest, prev: Certificate | None, accepted: Sequence[Accepted]
) -> list[RosterEntry]:
    """The roster of the version after ``prev`` with receipts ``accepted``: :func:`next_roster`
    of ``prev``'s roster under the manifest's window."""
    version = (prev.body.version if prev is not None else 0) + 1
    return next_roster(
        roster_of(manifest, prev),
        new_version=version,
        accepted=accepted,
        window=manifest.rules.roster_window,
    )


def with_roster(manifest: RunManifest, prev: Certificate | None, cert: Certificate) -> Certificate:
    """``cert`` with its roster derived: :func:`roster_after` ``prev`` with ``cert``'s receipts.
    Raises InvalidRecord if its hash is not the body's ``roster_hash``."""
    roster = roster_after(manifest, prev, cert.body.accepted)
    if roster_digest(roster) != cert.body.roster_hash:
        raise InvalidRecord(f"certificate for version {cert.body.version} carries a wrong roster")
    return replace(cert, roster=tuple(roster))


def beacon_of(run_id: str, cert: Certificate | None) -> bytes:
    """The election beacon after ``cert``: over its certified *content*, not its bytes.

    Syncers assemble different signature subsets for one body, and a certificate's bytes
    include the signatures; a later view re-certifying a locked content signs another body
    (view, committee) with the same content. Hashing the content gives every node the same
    beacon, whichever of those certificates it holds.
    """
    return committee.beacon(run_id, content_json(cert.body) if cert is not None else None)


def committee_for(
    run_id: str, manifest: RunManifest, cert: Certificate | None, view: int = 0
) -> CommitteeInfo:
    """The committee of view ``view`` of the round after ``cert`` (after genesis when None).

    View 0 is elected by :func:`committee.elect` over :func:`roster_of` with
    :func:`beacon_of`, committee size and eligibility (the trust thresholds of ``core.trust``)
    from the manifest. Later views (the committees that take over once earlier views timed
    out, ``protocol.view_change``) slide a window of k over a ranking of every candidate, with
    no last view (ADR 0055): view j starts at j × (k − q + 1), so each view replaces more
    members than can block a quorum and its first member leads. The first pass over the
    ranking puts view 0's members first (they hold the submissions), then the other eligible
    candidates, those with a delta in the base certificate first (the chain's best sign that
    they are live), in score order, then the rest; every later pass re-ranks the candidates with
    a beacon of its own, so the windows of one pass never repeat the compositions of the last
    and a blocking set cannot sit in every window. The committee is a function of
    (certificate, view) only: every node computes the same one, and the lock argument of
    ``protocol.view_change`` holds (ADR 0055 says why it cannot depend on who was silent). The
    quorum is the manifest's when the committee is full, else, for the m < k members found (a
    young run with a short roster), :func:`committee.short_quorum` of m, raised to m − (k − q)
    if the manifest asks for fewer absences than that.
    Raises ValueError if ``cert`` belongs to another run (a caller bug:
    ``parse_certificate(run_id=...)`` checks it) or ``view`` is out of range.
    """
    if cert is not None and cert.body.run != run_id:
        raise ValueError("certificate is for another run")
    base = cert.body.version if cert is not None else 0
    return committee_of_roster(
        manifest, roster_of(manifest, cert), base, beacon_of(run_id, cert), view
    )


# The smallest committee that tolerates a fault: f = ⌊(n − 1)/3⌋ is 0 below it (ADR 0055).
FAULT_TOLERANT_SIZE = 3


def _founders_alone(manifest: RunManifest, members: Sequence[str]) -> list[str]:
    """The founders among ``members`` when they alone should sit (ADR 0073), else [].

    A committee of one or two tolerates no faulty member (f = 0), so a member beside the
    founders (``genesis_roster``: the genesis committee, or the creator) adds no safety, only
    one more node whose departure stops the run: a committee of two needs both votes to
    certify or to end a view (never a lone vote). So while the election finds fewer than
    three members, and fewer than the manifest's k, and a founder among them, the founders
    among them sit alone, and later views rotate over them only. A young run that scores work
    merges only its founders' deltas until someone's work shows, so there the committee of
    two (a founder and the first newcomer credited) lasted several versions, and one volunteer
    of three leaving stopped the run for good (ADR 0072)."""
    if len(members) >= min(manifest.committee_size, FAULT_TOLERANT_SIZE):
        return []
    founders = {e.peer_id for e in genesis_roster(manifest)}
    kept = [m for m in members if m in founders]
    return kept if len(kept) < len(members) else []


def _pass_beacon(beacon: bytes, rank_pass: int) -> bytes:
    seed = b"p2pdiloco/view-pass/v1\x00" + beacon + rank_pass.to_bytes(8, "big")
    return hashlib.sha256(seed).digest()


def committee_of_roster(
    manifest: RunManifest,
    roster: Sequence[RosterEntry],
    base: int,
    beacon: bytes,
    view: int = 0,
) -> CommitteeInfo:
    """:func:`committee_for` on its inputs: the certified roster of version ``base`` and the
    beacon after it. Pure."""
    if not 0 <= view <= MAX_VIEW:
        raise ValueError(f"view {view} out of range")
    candidates = [
        committee.Candidate(
            peer_id=e.peer_id,
            joined_version=e.joined_version,
            accepted=e.accepted,
            accepted_tokens=e.tokens,
            vouched=e.peer_id in manifest.genesis_committee,
            last_version=e.last_version,
        )
        for e in roster
    ]
    k, r = manifest.committee_size, manifest.rules
    rules = committee.CommitteeRules(
        size=k,
        min_age_versions=r.trust_min_age,
        min_accepted=r.trust_min_accepted,
        recency=r.committee_recency,
    )
    members = committee.elect(candidates, version=base, beacon_bytes=beacon, rules=rules)
    founders = _founders_alone(manifest, members)
    if founders:
        members = founders
        candidates = [c for c in candidates if c.peer_id in founders]
    size = len(members)
    # A short committee tolerates the manifest's k − q absences, never more than its size is
    # safe for (ADR 0055): k = 4, q = 3 gives 3 members a quorum of 2, q = 4 keeps 3 of 3.
    short = max(committee.short_quorum(size), size - (k - manifest.quorum))
    q = manifest.quorum if size == k else min(size, short)
    if view:
        step = size - q + 1
        rank_pass, start = divmod(view * step, len(candidates))
        ranking = _ranking(candidates, members, base, beacon, rules, rank_pass)
        members = [ranking[(start + i) % len(ranking)] for i in range(size)]
    return CommitteeInfo(version=base + 1, members=tuple(members), quorum=q, view=view)


def _ranking(
    candidates: list[committee.Candidate],
    elected: list[str],
    base: int,
    beacon: bytes,
    rules: committee.CommitteeRules,
    rank_pass: int,
) -> list[str]:
    """Every candidate in the order later views seat them in pass ``rank_pass``: eligible
    candidates in score order, then the rest, so fresh identities sit only once every eligible
    one has had a seat and a run whose eligible members are down still finds a live quorum.
    Pass 0 puts view 0's members first and, among the other eligible ones, those with a delta
    in the base certificate; later passes draw with their own beacon."""
    pool = committee.eligible(candidates, base, rules)
    in_pool = set(pool)  # a list here made a view change at 10,000 peers take 25 s
    others = [c for c in candidates if c not in in_pool]
    draw = beacon if rank_pass == 0 else _pass_beacon(beacon, rank_pass)
    ranked = [
        p
        for group in (pool, others)
        if group
        for p in committee.elect(
            group, version=base, beacon_bytes=draw, rules=replace(rules, size=len(group))
        )
    ]
    if rank_pass:
        return ranked
    stale = {c.peer_id for c in candidates if c.last_version < base}
    seated, eligible = set(elected), {c.peer_id for c in pool}
    rest = [p for p in ranked if p not in seated]
    rest.sort(key=lambda p: (p not in eligible, p in stale))  # stable: score order within
    return elected + rest


def chain_lock(
    run_id: str, manifest: RunManifest, prev: Certificate | None, tcs: Sequence[TimeoutCert]
) -> str | None:
    """The content the version after ``prev`` must certify in the view after the last of
    ``tcs`` (None: free), from the timeout certificate of the view before it (ADR 0055: the
    last TC carries every earlier view's lock). Raises InvalidRecord if it does not prove its
    view's timeout."""
    if not tcs:
        return None
    tc = tcs[-1]
    info = committee_for(run_id, manifest, prev, tc.view)
    ok, lock = tc_lock(tc, info.members, info.quorum)
    if not ok:
        raise InvalidRecord(f"the votes for view {tc.view} do not prove that it timed out")
    return lock.content if lock is not None else None


def verify_successor(
    run_id: str, manifest: RunManifest, prev: Certificate | None, cert: Certificate
) -> Certificate:
    """Check that ``cert`` is what the committee elected after ``prev`` may certify, and return
    it with its roster derived (:func:`with_roster`).

    :func:`parse_certificate` only counts signatures of the committee the body itself names, so
    on its own it accepts a body in which anyone names themselves the committee. This closes
    the chain: run, ``base_version`` = prev's version (0 for genesis), ``version`` = base + 1,
    committee (in election order) and quorum = :func:`committee_for` of the body's view, the
    timeout certificate of the view before (a body of view j > 0 carries that of view j − 1)
    valid against that view's committee and the body's content the one it locks, if any
    (:func:`chain_lock`), and roster hash = that of
    :func:`next_roster` of prev's roster and ``cert``'s receipts. Raises InvalidRecord naming
    the first mismatch; apply nothing from a certificate that fails.
    """
    body = cert.body
    if body.run != run_id:
        raise InvalidRecord(f"certificate is for run {body.run[:12]}, expected {run_id[:12]}")
    info = committee_for(run_id, manifest, prev, body.view)
    if (body.base_version, body.version) != (info.version - 1, info.version):
        raise InvalidRecord(
            f"certificate moves {body.base_version} -> {body.version}, "
            f"expected {info.version - 1} -> {info.version}"
        )
    if tuple(body.committee) != info.members or body.quorum != info.quorum:
        raise InvalidRecord(
            f"certificate for version {body.version} names a committee or quorum "
            "other than the elected one"
        )
    lock = chain_lock(run_id, manifest, prev, cert.views)
    if lock is not None and content_digest(body) != lock:
        raise InvalidRecord(
            f"certificate for version {body.version} (view {body.view}) certifies another "
            f"content than the one an earlier view locked ({lock[:12]})"
        )
    return with_roster(manifest, prev, cert)
