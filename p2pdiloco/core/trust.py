"""Who is trusted in a round, and how much room the others get (ADR 0016).

Fresh identities cost nothing, so a round must not let a flood of them close it, fill it, own
its median or win its weight. Trust is earned in the certified history: an identity is
*trusted* for the round after certificate v when it is on the genesis committee, or when v's
roster credits it with at least ``trust_min_accepted`` accepted deltas and it joined at least
``trust_min_age`` versions before v. Everyone else is *probationary*:

- probationary submissions never close a round (the learner quorum counts trusted ones);
- an input set holds at most ``probation_room(t)`` probationary submissions next to t trusted
  ones, so they are at most ``probation_share`` of the inputs, whatever rule merges them;
- their merge weight is scaled to at most ``probation_share`` of the total;
- screening measures norms against the trusted inputs' median, not the round's;
- committee election uses the same threshold (``core.roster.committee_for``).

A young run treats everyone as trusted until k identities (a committee's worth) have earned
trust through the roster, as the election tops a young committee up with the creator's genesis
committee and then its oldest members. Genesis members count as trusted once that holds, but do
not end the young run by themselves: a creator's syncers that never train would otherwise
leave nobody able to close a round or earn trust. So a run is open to a flood of fresh
identities during its first ``trust_min_age``-odd versions, and closed to it from then on.
With work scoring (``rules.work``, ADR 0062) a receipt is scored work, and a young run no
longer trusts whoever arrives: until k identities have earned trust, the trusted are the genesis
committee and every identity with at least one receipt (everyone only before the first receipt,
so that a run can start). An identity that never showed work on its own data (a free rider)
therefore never closes a round, holds at most ``probation_share`` of one, and is never seated.
Everything here is a pure function of the signed manifest and the certificate: every syncer
agrees.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

from p2pdiloco.core.roster import genesis_roster, roster_of
from p2pdiloco.core.weights import ordered_sum
from p2pdiloco.protocol.certificates import Certificate, RosterEntry
from p2pdiloco.protocol.records import RunManifest

# Roster identities a round waits for: those with a delta merged (or that joined) in the last
# this many versions, the roster's whole window before ADR 0045.
AWAITED_VERSIONS = 3


def trusted_peers(manifest: RunManifest, cert: Certificate | None) -> frozenset[str] | None:
    """The identities trusted in the round after ``cert`` (after genesis when None), or None
    when the run is young and everyone counts as trusted."""
    base = cert.body.version if cert is not None else 0
    return trusted_of_roster(manifest, roster_of(manifest, cert), base)


def round_trusted(manifest: RunManifest, cert: Certificate | None) -> frozenset[str] | None:
    """Whose submissions close the round after ``cert`` and anchor its screening and weights:
    :func:`trusted_peers`, except in a young run under the z test (ADR 0070) while no one has
    earned trust, where it is the founders (``core.roster.genesis_roster``): the only learners
    whose deltas such a round can merge, as no stretch of a run's first versions shows work.
    A round there waits for a founder's delta instead of closing on newcomers' alone and
    failing its merge, while the founder, told its delta came late, waited for that round's
    certificate (ADR 0071)."""
    trusted = trusted_peers(manifest, cert)
    work = manifest.rules.work
    if trusted is None and work is not None and work.z_min is not None:
        return frozenset(e.peer_id for e in genesis_roster(manifest))
    return trusted


def trusted_of_roster(
    manifest: RunManifest, roster: Iterable[RosterEntry], base: int
) -> frozenset[str] | None:
    """:func:`trusted_peers` on its inputs: the certified roster of version ``base``."""
    rules = manifest.rules
    earned = {
        e.peer_id
        for e in roster
        if e.accepted >= rules.trust_min_accepted and base - e.joined_version >= rules.trust_min_age
    }
    if len(earned) >= manifest.committee_size:
        return frozenset(earned | set(manifest.genesis_committee))
    if rules.work is None:
        return None
    worked = {e.peer_id for e in roster if e.accepted >= 1 and base > e.joined_version}
    return frozenset(worked | set(manifest.genesis_committee)) if worked else None


def trust_progress(manifest: RunManifest, cert: Certificate | None) -> dict[str, int]:
    """Accepted deltas per identity on the certified roster after ``cert`` (``RoundParams
    .progress``): how close each probationary one is to ``trust_min_accepted``."""
    return {e.peer_id: e.accepted for e in roster_of(manifest, cert)}


def trusted_count(trusted: frozenset[str] | None, peers: Iterable[str]) -> int:
    """How many of ``peers`` are trusted (all of them in a young run): the learners a round
    waits for. Probationary ones never close a round, so counting them would only keep it
    open to its grace: a flood of fresh identities would slow every round that way."""
    return sum(1 for p in peers if trusted is None or p in trusted)


def learners_awaited(
    manifest: RunManifest, cert: Certificate | None, live: Collection[str]
) -> tuple[int, int]:
    """The learners the round after ``cert`` waits for, and how many of them are trusted: the
    live ones (heartbeats), or the certified roster's when more (heartbeats lag at start-up).
    Of the roster, only identities active in the last ``AWAITED_VERSIONS`` versions count: the
    roster keeps idle ones longer (``rules.roster_window``), and a learner that left must not
    hold the round open (ADR 0045)."""
    trusted = round_trusted(manifest, cert)
    base = cert.body.version if cert is not None else 0
    roster = [
        e.peer_id
        for e in roster_of(manifest, cert)
        if base - max(e.last_version, e.joined_version) <= AWAITED_VERSIONS
    ]
    count = max(len(live), len(roster))
    return count, max(trusted_count(trusted, live), trusted_count(trusted, roster))


def probation_room(trusted: int, share: float, floor: int = 0) -> int:
    """Probationary submissions an input set may hold next to ``trusted`` trusted ones: the
    most p with p ≤ share × (trusted + p), and at least ``floor`` (1 in a run that scores work,
    ADR 0066: there a probationary delta is merged only if it shows work on its own data, and
    without the floor a run of one or two trusted learners would never let a newcomer in)."""
    if share >= 1.0:
        return 2**31
    return max(floor, math.floor(share / (1.0 - share) * trusted + 1e-9))


def cap_probation(
    weights: Mapping[str, float], probationary: frozenset[str], share: float
) -> dict[str, float]:
    """``weights`` with the probationary entries scaled down together so that they hold at
    most ``share`` of the total (in the mapping's order: every node gets the same floats)."""
    out = dict(weights)
    low = ordered_sum(w for k, w in out.items() if k in probationary)
    high = ordered_sum(w for k, w in out.items() if k not in probationary)
    if low <= 0 or share >= 1.0 or low <= share * (low + high):
        return out
    scale = share * high / ((1.0 - share) * low)
    return {k: (w * scale if k in probationary else w) for k, w in out.items()}
