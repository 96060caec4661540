"""The contribution ledger: who did what, from verified certificates only.

Each certificate's ``accepted`` list is the committee's signed receipt for every delta it
merged (peer, submission id, steps, tokens). The ledger walks the certificate chain from
genesis, keeps a certificate only if it verifies as the successor of the previous one (quorum of
the elected committee, roster that follows), and sums receipts per peer. Anything else it was
given — a certificate with a bad or missing signature, a receipt someone edited (which breaks
every signature over that body), a certificate by a self-appointed committee, a gap — is ignored
and listed in ``ignored`` with the reason, so a leaderboard never counts a claim.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from p2pdiloco.core.roster import verify_successor
from p2pdiloco.protocol.certificates import Certificate, body_digest, parse_certificate
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord


@dataclass
class LedgerEntry:
    peer_id: str
    accepted: int = 0  # deltas merged (receipts)
    tokens: int = 0  # tokens of merged deltas
    rejected: int = 0  # deltas screened out, as certified
    last_version: int = 0  # newest version with a receipt

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Ledger:
    versions: int  # length of the verified chain
    entries: list[LedgerEntry]  # ranked: tokens, then accepted, then peer id
    ignored: list[str] = field(default_factory=list)  # one line per rejected input

    @property
    def total_tokens(self) -> int:
        return sum(e.tokens for e in self.entries)

    def rank_of(self, peer_id: str) -> int | None:
        for i, e in enumerate(self.entries, 1):
            if e.peer_id == peer_id:
                return i
        return None

    def to_dict(self) -> dict[str, Any]:
        total = self.total_tokens or 1
        return {
            "versions": self.versions,
            "total_tokens": self.total_tokens,
            "peers": [
                {"rank": i, **e.to_dict(), "share": e.tokens / total}
                for i, e in enumerate(self.entries, 1)
            ],
            "ignored": self.ignored,
        }


def build_ledger(run_id: str, manifest: RunManifest, certificates: Iterable[bytes]) -> Ledger:
    """Verify and sum ``certificates`` (raw bytes, any order, duplicates and junk allowed)."""
    chain, ignored = verified_chain(run_id, manifest, certificates)
    entries: dict[str, LedgerEntry] = {}
    for cert in chain:
        for a in cert.body.accepted:
            entry = entries.setdefault(a.peer_id, LedgerEntry(a.peer_id))
            entry.accepted += 1
            entry.tokens += a.tokens
            entry.last_version = cert.body.version
        for r in cert.body.rejected:
            entries.setdefault(r.peer_id, LedgerEntry(r.peer_id)).rejected += 1
    ranked = sorted(entries.values(), key=lambda x: (-x.tokens, -x.accepted, x.peer_id))
    return Ledger(versions=len(chain), entries=ranked, ignored=ignored)


def verified_chain(
    run_id: str, manifest: RunManifest, certificates: Iterable[bytes]
) -> tuple[list[Certificate], list[str]]:
    """The chain from genesis that ``certificates`` (raw bytes, any order, duplicates and junk
    allowed) verify, each with its roster derived (ADR 0044), and one line per certificate
    left out."""
    ignored: list[str] = []
    by_version: dict[int, list[Certificate]] = defaultdict(list)
    for raw in certificates:
        try:
            cert = parse_certificate(raw, run_id=run_id)
        except InvalidRecord as e:
            ignored.append(f"certificate ignored: {e}")
            continue
        by_version[cert.body.version].append(cert)

    chain: list[Certificate] = []
    prev: Certificate | None = None
    version = 1
    while by_version.get(version):
        chosen = None
        for cert in by_version.pop(version):
            try:
                cert = verify_successor(run_id, manifest, prev, cert)
            except InvalidRecord as e:
                ignored.append(f"certificate for version {version} ignored: {e}")
                continue
            if chosen is None:
                chosen = cert
            elif body_digest(cert.body) != body_digest(chosen.body):
                ignored.append(
                    f"second, different certificate for version {version} ignored "
                    "(a committee signed two states: report it)"
                )
        if chosen is None:
            break
        chain.append(chosen)
        prev = chosen
        version += 1
    for v in sorted(by_version):
        if by_version[v]:
            ignored.append(f"certificate for version {v} ignored: version {version} is missing")
    return chain, ignored
