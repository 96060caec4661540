"""What a roster of N identities costs, now that certificates carry only its hash (ADR 0044).

For each roster size N: the bytes the roster would add to every certificate if it were carried
(its canonical JSON, what certificates held before ADR 0044; the limit is 1 MiB), the bytes a
certificate with 4,096 receipts has now, the memory a node holds for the derived roster
(tracemalloc), and the time of the work each node does per version with it: ``next_roster``
over N receipts, the election of view 0 and of view 1 (``committee_of_roster``), and the
trusted set (``trusted_of_roster``). Peer ids are real Ed25519 identities from fixed seeds.

    .venv/bin/python bench/roster_scale.py                      # N = 1,024, 10,000, 65,536
    .venv/bin/python bench/roster_scale.py --sizes 1024,16384 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import tracemalloc
from typing import Any

from p2pdiloco.core.roster import MAX_ROSTER, committee_of_roster, genesis_roster, next_roster
from p2pdiloco.core.trust import trusted_of_roster
from p2pdiloco.protocol.certificates import (
    Accepted,
    CertificateBody,
    assemble,
    roster_digest,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest, run_id_of
from p2pdiloco.protocol.signing import canonical_json

# A certificate's most receipts, and its byte limit, when ADR 0044 was measured: ADR 0047 has
# since raised them to 16,384 and 8 MiB. Kept, so the table of ADR 0044 is what this prints.
RECEIPTS = 4096
LIMIT_THEN = 1 << 20


def _manifest(creator: Identity) -> RunManifest:
    return RunManifest.model_validate(
        {
            "protocol_version": 1,
            "name": "roster-scale",
            "model": "gpt-tiny",
            "data": "embedded",
            "seed": 0,
            "creator": creator.peer_id,
            "created_at": 1_800_000_000.0,
            "committee_size": 16,
            "inner_steps": 20,
        }
    )


def _timed(fn: Any, repeat: int = 3) -> tuple[Any, float]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def measure(n: int, ids: list[str], creator: Identity) -> dict[str, Any]:
    m = _manifest(creator)
    version = 10
    receipts = sorted(
        (
            Accepted(
                peer_id=p,
                digest=hashlib.sha256(p.encode()).hexdigest(),
                steps=100,
                tokens=100 * 1024,
            )
            for p in ids[:n]
        ),
        key=lambda a: a.digest,
    )
    prev = genesis_roster(m)
    roster, next_s = _timed(lambda: next_roster(prev, new_version=version, accepted=receipts))
    tracemalloc.start()  # apart from the timing: it slows every allocation
    again = next_roster(prev, new_version=version, accepted=receipts)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert again == roster
    roster_json = len(canonical_json([e.model_dump(mode="json") for e in roster]))
    body = CertificateBody(
        run=run_id_of(m),
        version=version + 1,
        base_version=version,
        state_hash="cd" * 32,
        committee=[creator.peer_id],
        quorum=1,
        accepted=receipts[:RECEIPTS],
        roster_hash=roster_digest(roster),
    )
    cert_now = len(assemble(body, {creator.peer_id: sign_body(creator, body)}))
    beacon = hashlib.sha256(b"beacon").digest()
    later = version + 5  # every entry old enough to be eligible and trusted
    _, view0_s = _timed(lambda: committee_of_roster(m, roster, later, beacon, 0))
    _, view1_s = _timed(lambda: committee_of_roster(m, roster, later, beacon, 1))
    _, trusted_s = _timed(lambda: trusted_of_roster(m, roster, later))
    return {
        "roster": len(roster),
        "roster_json_bytes": roster_json,
        "carried_cert_bytes": cert_now + roster_json,
        "fits_carried": cert_now + roster_json <= LIMIT_THEN,
        "cert_bytes_now": cert_now,
        "held_bytes": held,
        "next_roster_s": next_s,
        "elect_view0_s": view0_s,
        "elect_view1_s": view1_s,
        "trusted_s": trusted_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=f"1024,10000,{MAX_ROSTER}")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if max(sizes) > MAX_ROSTER:
        ap.error(f"sizes above MAX_ROSTER ({MAX_ROSTER}) are cut to it")
    creator = Identity.from_seed(b"\x01" * 32)
    ids = [
        Identity.from_seed(hashlib.sha256(b"r%d" % i).digest()).peer_id for i in range(max(sizes))
    ]
    rows = [measure(n, ids, creator) for n in sizes]
    if args.json:
        json.dump({"rows": rows}, sys.stdout, indent=1)
        return 0
    print(
        f"{'roster':>7} {'carried':>10} {'fits 1MiB':>9} {'cert now':>9} {'held':>9} "
        f"{'next_roster':>11} {'view 0':>7} {'view 1':>7} {'trusted':>7}"
    )
    for r in rows:
        fits = str(r["fits_carried"])
        print(
            f"{r['roster']:>7} {r['carried_cert_bytes'] / 1e6:>8.2f}MB {fits:>9} "
            f"{r['cert_bytes_now'] / 1e3:>7.0f}kB {r['held_bytes'] / 1e6:>7.1f}MB "
            f"{r['next_roster_s'] * 1e3:>9.0f}ms {r['elect_view0_s'] * 1e3:>5.0f}ms "
            f"{r['elect_view1_s'] * 1e3:>5.0f}ms {r['trusted_s'] * 1e3:>5.0f}ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
