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
    uncredited: int = 0  # deltas merged without credit: no work shown (ADR 0065)
    last_version: int = 0  # newest version with a receipt
    reasons: dict[str, int] = field(default_factory=dict)  # of ``rejected``: code → count

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "reasons": dict(self.reasons)}


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
            if not a.credited:
                entry.uncredited += 1
                continue
            entry.accepted += 1
            entry.tokens += a.tokens
            entry.last_version = cert.body.version
        for r in cert.body.rejected:
            entry = entries.setdefault(r.peer_id, LedgerEntry(r.peer_id))
            entry.rejected += 1
            entry.reasons[str(r.reason)] = entry.reasons.get(str(r.reason), 0) + 1
    ranked = sorted(entries.values(), key=lambda x: (-x.tokens, -x.accepted, x.peer_id))
    return Ledger(versions=len(chain), entries=ranked, ignored=ignored)


def verified_chain(
    run_id: str, manifest: RunManifest, certificates: Iterable[bytes]
) -> tuple[list[Certificate], list[str]]:
    """The chain from genesis that ``certificates`` (raw bytes, any order, duplicates and junk
    allowed) verify, each with its roster derived (ADR 0044), and one line per certificate
    left out."""
    follower = ChainFollower(run_id, manifest, ahead=None)
    parsed: list[Certificate] = []
    for raw in certificates:
        try:
            parsed.append(parse_certificate(raw, run_id=run_id))
        except InvalidRecord as e:
            follower.ignored.append(f"certificate ignored: {e}")
    for cert in sorted(parsed, key=lambda c: c.body.version):  # stable: first given, first tried
        follower.offer(cert)
    for v in sorted(follower.pending):
        for _ in follower.pending[v]:
            follower.ignored.append(
                f"certificate for version {v} ignored: version {follower.version + 1} is missing"
            )
    return follower.chain, follower.ignored


@dataclass
class ChainFollower:
    """The verified chain of one run, grown one certificate at a time from genesis.

    ``offer`` takes a certificate whose signatures ``parse_certificate`` checked and appends it
    if it verifies as the successor of the tip (``verify_successor``: the elected committee, its
    quorum, the roster that follows); one for a later version waits in ``pending`` until the
    versions below it arrive. Anything else is dropped with one line in ``ignored``: a
    certificate of a version already verified (a second, different body is reported: a
    committee signed two states), or one that does not verify where it would fit.

    Bounded for input nobody vouches for (a bootstrap's gossip): with ``ahead`` set, only
    versions tip + 2 … tip + ``ahead`` wait, at most ``PER_VERSION`` bodies each and
    ``PENDING_BYTES`` in all (waiting is only a shortcut: a certificate dropped here is fetched
    again when the chain reaches its version), and ``ignored`` keeps the last ``MAX_IGNORED``
    lines; ``chain`` keeps the last ``keep`` certificates (None: all). A forged certificate
    thus costs one signature check and, where it would fit, one election, and holds bounded
    memory.
    """

    run_id: str
    manifest: RunManifest
    ahead: int | None = 64  # versions above the tip that may wait (None: unbounded)
    keep: int | None = None  # certificates of the chain kept (None: all)
    chain: list[Certificate] = field(default_factory=list)
    pending: dict[int, list[Certificate]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    version: int = 0  # the verified tip's version (0: genesis)
    tip: Certificate | None = None

    PER_VERSION = 4
    PENDING_BYTES = 1 << 20  # raw certificate bytes waiting, with ``ahead`` set
    MAX_IGNORED = 256

    def offer(self, cert: Certificate) -> list[Certificate]:
        """Take ``cert``; returns the certificates it let the chain grow by, in order."""
        v = cert.body.version
        if v <= self.version:
            if self.tip is not None and v == self.version:
                self._check_twin(cert)
            return []
        if v > self.version + 1:
            waiting = self.pending.get(v, [])
            if self.ahead is not None and (
                v > self.version + self.ahead
                or len(waiting) >= self.PER_VERSION
                or self.pending_bytes() + len(cert.raw) > self.PENDING_BYTES
            ):
                return []
            if all(body_digest(c.body) != body_digest(cert.body) for c in waiting):
                self.pending.setdefault(v, []).append(cert)
            return []
        grown: list[Certificate] = []
        candidates = [cert]
        while candidates:
            nxt = self._first_successor(candidates)
            if nxt is None:
                break
            grown.append(nxt)
            candidates = self.pending.pop(self.version + 1, [])
        if self.ahead is not None:  # versions now out of reach or behind the tip
            for w in [w for w in self.pending if w <= self.version]:
                del self.pending[w]
        return grown

    def pending_bytes(self) -> int:
        return sum(len(c.raw) for certs in self.pending.values() for c in certs)

    def _first_successor(self, candidates: list[Certificate]) -> Certificate | None:
        version = self.version + 1
        chosen: Certificate | None = None
        for cert in candidates:
            try:
                cert = verify_successor(self.run_id, self.manifest, self.tip, cert)
            except InvalidRecord as e:
                self._ignore(f"certificate for version {version} ignored: {e}")
                continue
            if chosen is None:
                chosen = cert
            elif body_digest(cert.body) != body_digest(chosen.body):
                self._ignore(_TWIN.format(version=version))
        if chosen is not None:
            self.chain.append(chosen)
            if self.keep is not None and len(self.chain) > self.keep:
                del self.chain[: len(self.chain) - self.keep]
            self.tip, self.version = chosen, version
        return chosen

    def _check_twin(self, cert: Certificate) -> None:
        """A certificate of the tip's version: a second, different body that verifies means a
        committee signed two states."""
        assert self.tip is not None
        if body_digest(cert.body) == body_digest(self.tip.body):
            return
        prev = self.chain[-2] if len(self.chain) >= 2 else None
        if prev is None and self.version > 1:
            return  # the tip's predecessor is no longer kept: cannot tell
        try:
            verify_successor(self.run_id, self.manifest, prev, cert)
        except InvalidRecord as e:
            self._ignore(f"certificate for version {self.version} ignored: {e}")
            return
        self._ignore(_TWIN.format(version=self.version))

    def _ignore(self, line: str) -> None:
        self.ignored.append(line)
        if self.ahead is not None and len(self.ignored) > self.MAX_IGNORED:
            del self.ignored[: len(self.ignored) - self.MAX_IGNORED]


_TWIN = (
    "second, different certificate for version {version} ignored "
    "(a committee signed two states: report it)"
)
