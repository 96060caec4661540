"""The contribution ledger counts verified receipts only; the leaderboard CLI shows it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from p2pdiloco.core.ledger import build_ledger
from p2pdiloco.core.roster import committee_for, next_roster, roster_of, with_roster
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.certificates import (
    Accepted,
    Certificate,
    CertificateBody,
    assemble,
    parse_certificate,
    roster_digest,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from tests.netutil import run_cli as forked_cli

SYNCERS = [Identity.from_seed(hashlib.sha256(b"ledger%d" % i).digest()) for i in range(4)]
LEARNER_KEYS = [Identity.from_seed(hashlib.sha256(b"learner%d" % i).digest()) for i in range(3)]
LEARNERS = [k.peer_id for k in LEARNER_KEYS]
BY_ID = {k.peer_id: k for k in SYNCERS + LEARNER_KEYS}
RUN_ID, MANIFEST, MANIFEST_RAW = create_manifest(
    SYNCERS[0],
    name="ledger",
    model="gemma-tiny",
    data="embedded",
    seed=0,
    inner_steps=10,
    committee_size=4,
    genesis_committee=[s.peer_id for s in SYNCERS],
)


def receipt(peer: str, tokens: int, version: int) -> Accepted:
    digest = hashlib.sha256(f"{peer}/{version}".encode()).hexdigest()
    return Accepted(peer_id=peer, digest=digest, steps=10, tokens=tokens)


def successor(prev: Certificate | None, accepted: list[Accepted]) -> Certificate:
    info = committee_for(RUN_ID, MANIFEST, prev)
    accepted = sorted(accepted, key=lambda a: a.digest)
    body = CertificateBody(
        run=RUN_ID,
        version=info.version,
        base_version=info.version - 1,
        state_hash="cd" * 32,
        committee=list(info.members),
        quorum=info.quorum,
        accepted=accepted,
        roster_hash=roster_digest(
            next_roster(roster_of(MANIFEST, prev), new_version=info.version, accepted=accepted)
        ),
    )
    signers = [BY_ID[p] for p in body.committee if p in BY_ID]
    raw = assemble(body, {s.peer_id: sign_body(s, body) for s in signers})
    return with_roster(MANIFEST, prev, parse_certificate(raw))


def honest_chain(versions: int = 3) -> list[Certificate]:
    chain: list[Certificate] = []
    prev = None
    for v in range(1, versions + 1):
        # learner i contributes (i + 1) × 100 tokens each version; learner 2 skips version 2
        accepted = [
            receipt(p, (i + 1) * 100, v) for i, p in enumerate(LEARNERS) if not (i == 2 and v == 2)
        ]
        prev = successor(prev, accepted)
        chain.append(prev)
    return chain


def forged(cert: Certificate, peer: str, tokens: int) -> bytes:
    """The same certificate with one receipt's tokens edited: every signature breaks."""
    obj = json.loads(cert.raw)
    for a in obj["body"]["accepted"]:
        if a["peer_id"] == peer:
            a["tokens"] = tokens
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def test_ledger_sums_verified_receipts_and_ranks_by_tokens() -> None:
    chain = honest_chain()
    ledger = build_ledger(RUN_ID, MANIFEST, [c.raw for c in reversed(chain)] + [chain[0].raw])
    assert ledger.versions == 3 and ledger.ignored == []
    tokens = {e.peer_id: e.tokens for e in ledger.entries}
    assert tokens == {LEARNERS[0]: 300, LEARNERS[1]: 600, LEARNERS[2]: 600}
    # ties on tokens go to more accepted deltas
    assert [e.peer_id for e in ledger.entries][:1] == [LEARNERS[1]]
    assert ledger.rank_of(LEARNERS[0]) == 3


def test_a_forged_receipt_is_ignored_and_reported() -> None:
    chain = honest_chain()
    bad = forged(chain[1], LEARNERS[0], 10**12)
    ledger = build_ledger(RUN_ID, MANIFEST, [chain[0].raw, bad, chain[2].raw])
    assert ledger.versions == 1  # the chain stops at the missing (forged) version 2
    assert {e.peer_id: e.tokens for e in ledger.entries}[LEARNERS[0]] == 100
    assert any("signatures" in line for line in ledger.ignored), ledger.ignored
    assert any("version 3" in line for line in ledger.ignored), ledger.ignored

    # beside the honest copy, the forged one changes nothing but is still reported
    ledger = build_ledger(RUN_ID, MANIFEST, [c.raw for c in chain] + [bad])
    assert ledger.versions == 3
    assert {e.peer_id: e.tokens for e in ledger.entries}[LEARNERS[0]] == 300
    assert len(ledger.ignored) == 1


def test_self_appointed_committee_is_ignored() -> None:
    chain = honest_chain(1)
    outsider = Identity.generate()
    body = CertificateBody(
        run=RUN_ID,
        version=2,
        base_version=1,
        state_hash="ab" * 32,
        committee=[outsider.peer_id],
        quorum=1,
        accepted=[receipt(outsider.peer_id, 10**9, 2)],
        roster_hash=roster_digest([]),
    )
    raw = assemble(body, {outsider.peer_id: sign_body(outsider, body)})
    ledger = build_ledger(RUN_ID, MANIFEST, [chain[0].raw, raw])
    assert ledger.versions == 1 and outsider.peer_id not in {e.peer_id for e in ledger.entries}
    assert any("committee" in line for line in ledger.ignored)


def test_leaderboard_cli_from_a_state_directory(tmp_path: Path) -> None:
    chain = honest_chain()
    (tmp_path / "certs").mkdir()
    (tmp_path / "manifest.json").write_bytes(MANIFEST_RAW)
    for c in chain[:2]:
        (tmp_path / "certs" / f"{c.body.version:08d}.json").write_bytes(c.raw)
    (tmp_path / "certs" / "00000003.json").write_bytes(forged(chain[2], LEARNERS[2], 10**12))
    out = forked_cli("status", "--leaderboard", "--state-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    board = json.loads(out.stdout)
    assert board["versions"] == 2
    assert [p["peer_id"] for p in board["peers"]] == [LEARNERS[1], LEARNERS[2], LEARNERS[0]]
    assert board["peers"][0]["tokens"] == 400 and board["peers"][0]["rank"] == 1
    assert len(board["ignored"]) == 1 and "signatures" in board["ignored"][0]

    text = forked_cli(
        "status",
        "--leaderboard",
        "--state-dir",
        str(tmp_path),
        env={**__import__("os").environ, "COLUMNS": "120"},
    )
    assert text.returncode == 0 and "ignored:" in text.stdout and "400" in text.stdout


def test_a_delta_merged_without_credit_is_no_receipt() -> None:
    """ADR 0065: a trusted delta that showed no work is merged with a 0-token receipt. It is
    certified (its learner does not send the work again) but credits nothing: no roster
    progress, no receipt of its peer, no tokens on the ledger, counted as uncredited."""
    lazy = LEARNERS[0]
    first = successor(None, [receipt(p, 100, 1) for p in LEARNERS])
    second = successor(first, [receipt(lazy, 0, 2), receipt(LEARNERS[1], 100, 2)])
    assert [a.tokens for a in second.body.accepted if a.peer_id == lazy] == [0]
    assert second.receipts(lazy) == [] and len(second.receipts(LEARNERS[1])) == 1
    assert second.roster is not None
    roster = {e.peer_id: e for e in second.roster}
    assert (roster[lazy].accepted, roster[lazy].last_version) == (1, 1)  # no progress at v2
    assert (roster[LEARNERS[1]].accepted, roster[LEARNERS[1]].last_version) == (2, 2)
    ledger = build_ledger(RUN_ID, MANIFEST, [first.raw, second.raw])
    entry = {e.peer_id: e for e in ledger.entries}[lazy]
    assert (entry.accepted, entry.tokens, entry.uncredited) == (1, 100, 1)


def test_a_node_counts_its_delta_merged_without_credit_apart() -> None:
    """The volunteer's own tally (dashboard, status.json): a delta merged without credit is
    merged (its learner sends that work no more) but neither accepted nor rejected."""
    from p2pdiloco.dashboard.live import DashboardSnapshot, plain_line
    from p2pdiloco.runtime.status import Tally

    lazy = LEARNERS[0]
    first = successor(None, [receipt(p, 100, 1) for p in LEARNERS])
    second = successor(first, [receipt(lazy, 0, 2), receipt(LEARNERS[1], 100, 2)])
    tally = Tally()
    merged, rejected = tally.record_chain([first, second], lazy)
    assert receipt(lazy, 0, 2).digest in merged and not rejected
    assert (tally.accepted, tally.uncredited, tally.rejected, tally.tokens_accepted) == (
        1,
        1,
        0,
        100,
    )
    snap = DashboardSnapshot(peer_id=lazy, accepted=1, uncredited=1)
    assert "deltas 1 accepted 1 uncredited" in plain_line(snap)
