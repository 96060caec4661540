"""Syncer committee election: who merges, screens and certifies the next global version.

Pure functions of public, certified data, so any node computes the same committee and anyone
can check a claimed one:

- the **beacon** of round v+1 is sha256 over a domain tag and the quorum certificate of version
  v (for the first round: the run id). Nobody knows it before v is certified, so nobody can
  position themselves for a future committee;
- **eligibility** needs time in the run and accepted work: a peer must have been a member since
  at least ``min_age_versions`` versions, hold at least ``min_accepted`` accepted deltas
  (receipts), have had one merged in the last ``recency`` versions (it is still there), and not
  be banned. Until enough peers qualify (the first rounds of a run), the
  oldest members fill the committee, so a run can start;
- the draw is **weighted rendezvous hashing**: each eligible peer gets the score
  ``-weight / ln(u)`` with ``u`` uniform in (0, 1) from sha256(beacon ‖ peer id), and the k
  highest scores form the committee. Weights (accepted tokens, capped) make a Sybil flood of
  fresh identities worthless: they have no weight and no eligibility.

Quorum q = floor(2k/3) + 1 signatures certify a version; fewer than k/3 faulty syncers can
neither certify a wrong state nor block a right one. A committee that finds fewer than k
candidates (a young or small run) uses :func:`short_quorum` of its actual size instead: the
smallest quorum still safe for the faults that size tolerates (ADR 0055).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from p2pdiloco.core.weights import capped_weights

BEACON_DOMAIN = b"p2pdiloco/beacon/v1\x00"
_SCORE_DOMAIN = b"p2pdiloco/committee/v1\x00"


def beacon(run_id: str, certificate: bytes | None) -> bytes:
    """The randomness of the next draw: H(certificate of the last version), or H(run id)."""
    seed = certificate if certificate is not None else run_id.encode()
    return hashlib.sha256(BEACON_DOMAIN + seed).digest()


@dataclass(frozen=True)
class Candidate:
    """What the certified history says about one peer."""

    peer_id: str
    joined_version: int  # first global version at which the peer was a member
    accepted: int = 0  # accepted deltas (receipts)
    accepted_tokens: int = 0  # tokens of accepted deltas, the draw weight
    banned: bool = False
    vouched: bool = False  # named by the run's creator (genesis committee): tops up first
    last_version: int = 0  # the version that last merged one of its deltas


@dataclass(frozen=True)
class CommitteeRules:
    """Per-run election parameters (from the run manifest)."""

    size: int  # k
    min_age_versions: int = 2
    min_accepted: int = 1
    weight_cap_fraction: float = 0.1  # no peer weighs more than this share of the total
    recency: int | None = None  # a delta merged in the last this many versions; None: any


def quorum(size: int) -> int:
    """floor(2k/3) + 1 for a committee of k ≥ 1."""
    if size < 1:
        raise ValueError("committee size must be at least 1")
    return (2 * size) // 3 + 1


def short_quorum(size: int) -> int:
    """The smallest q with 2q > n + f for a committee of n = ``size`` and f = ⌊(n − 1)/3⌋:
    any two quorums share f + 1 members (one correct, which signs one state per view), and
    n − q ≥ f members may be gone. Equal to :func:`quorum` except for n divisible by 3, where it
    is one less (n = 3: 2, so one departure of three does not stop the committee)."""
    if size < 1:
        raise ValueError("committee size must be at least 1")
    return (size + (size - 1) // 3) // 2 + 1


def _uniform(beacon_bytes: bytes, peer_id: str) -> float:
    digest = hashlib.sha256(_SCORE_DOMAIN + beacon_bytes + peer_id.encode()).digest()
    # 53 random bits → a double strictly inside (0, 1).
    return (int.from_bytes(digest[:8], "big") >> 11 | 1) / 2.0**53


def eligible(
    candidates: Iterable[Candidate], version: int, rules: CommitteeRules
) -> list[Candidate]:
    """Peers that may sit on the committee of round ``version + 1``."""
    return sorted(
        (
            c
            for c in candidates
            if not c.banned
            and version - c.joined_version >= rules.min_age_versions
            and c.accepted >= rules.min_accepted
            and (rules.recency is None or version - c.last_version < rules.recency)
        ),
        key=lambda c: c.peer_id,
    )


def _weights(pool: Sequence[Candidate], cap_fraction: float) -> dict[str, float]:
    raw = {c.peer_id: float(max(c.accepted_tokens, 1)) for c in pool}
    return {p: max(w, 1.0) for p, w in capped_weights(raw, cap_fraction).items()}


def elect(
    candidates: Iterable[Candidate],
    *,
    version: int,
    beacon_bytes: bytes,
    rules: CommitteeRules,
) -> list[str]:
    """The committee (peer ids, best score first) for the round that produces ``version + 1``.

    Uses eligible peers; if fewer than k qualify, tops up with the vouched members, then the
    longest-standing unbanned ones (ties by peer id) with unit weight, so a young run still
    gets a committee and fresh identities do not take its seats before the creator's. Returns
    fewer than k ids only if fewer than k unbanned candidates exist at all.
    """
    everyone = [c for c in candidates if not c.banned]
    pool = eligible(everyone, version, rules)
    if len(pool) < rules.size:
        taken = {c.peer_id for c in pool}
        seniors = sorted(
            (c for c in everyone if c.peer_id not in taken),
            key=lambda c: (not c.vouched, c.joined_version, c.peer_id),
        )
        pool = pool + seniors[: rules.size - len(pool)]
    weights = _weights(pool, rules.weight_cap_fraction)
    scored = sorted(
        (
            (-weights[c.peer_id] / math.log(_uniform(beacon_bytes, c.peer_id)), c.peer_id)
            for c in pool
        ),
        key=lambda s: (-s[0], s[1]),
    )
    return [peer for _, peer in scored[: rules.size]]


def verify_committee(
    claimed: Sequence[str],
    candidates: Iterable[Candidate],
    *,
    version: int,
    beacon_bytes: bytes,
    rules: CommitteeRules,
) -> bool:
    """True if ``claimed`` is exactly the committee anyone would draw from the same inputs."""
    expected = elect(candidates, version=version, beacon_bytes=beacon_bytes, rules=rules)
    return list(claimed) == expected
