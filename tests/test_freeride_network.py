"""Issue 44's free riders against real processes: a replayed public update earns nothing.

Three honest nodes (the genesis committee, k = q = 3) train a run that scores work
(``rules.work``, ADR 0062). Free riders, fresh identities that never train, send for every
certified version the run's own certified update of that version, fetched over the real
``cert`` and ``update`` ops (the same bytes from every rider), claiming an honest delta's
credit: steps = H, tokens = H × batch × seq_len (``p2pdiloco.harness.freeride``).

This file: four riders from version 0 (the young run); two arriving in a mature run:
``tests/test_freeride_mature_network.py``. Outcome (the issue's "what it must show"): they never sit on a committee, earn no receipt, no
token and no trust on the certified roster (as ``status --leaderboard`` reads it), and the
honest nodes certify on. Before ADR 0062 the young-run attack seated riders by v4 and stopped
the run; the pace beside a clean run over the same minutes is measured by
``bench/freeride.py --real`` (docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.core.ledger import build_ledger
from p2pdiloco.core.trust import trusted_peers
from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import NodeProc
from p2pdiloco.harness.freeride import RideReport, ride
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest, WorkScoring
from tests.test_sync_network import SMALL, verified_certificates

pytestmark = [pytest.mark.slow, pytest.mark.solo, pytest.mark.timeout(600)]

WORK = WorkScoring().model_dump()
ROUNDS = 5  # versions the riders send for


def check_outcome(
    node: NodeProc, run_id: str, manifest: RunManifest, keys: list[Identity], report: RideReport
) -> None:
    riders, honest = set(report.riders), {k.peer_id for k in keys}
    raws = [p.read_bytes() for p in sorted((node.dir / "state" / "certs").glob("*.json"))]
    certs = verified_certificates(node, run_id, manifest)
    assert len(certs) == len(raws), "the saved chain verifies from genesis"
    assert len(report.sent_for) >= ROUNDS - 1, report.sent_for  # they rode every version
    assert report.accepted >= 1, report.replies[:5]  # their sends got into rounds' pools
    for c in certs:  # never on a committee
        assert not riders & set(c.body.committee), f"a free rider sat on v{c.body.version}"
    ridden = [c for c in certs if c.body.version > report.first_base]
    assert len(ridden) >= ROUNDS
    for c in ridden:  # the committee still merged honest work every version
        assert sum(a.peer_id in honest for a in c.body.accepted) >= 2, c.body.accepted
    refused = [r for c in ridden for r in c.body.rejected if r.peer_id in riders]
    assert refused, (
        "no rider's replay reached a merge",
        report.lags,
        report.replies,
    )  # the committee saw them and said no
    assert all("replays" in r.reason or "advantage" in r.reason for r in refused), refused
    board = build_ledger(run_id, manifest, raws).to_dict()  # what `status --leaderboard` shows
    by_peer = {p["peer_id"]: p for p in board["peers"]}
    for peer in riders:
        row = by_peer.get(peer, {"accepted": 0, "tokens": 0})
        assert (row["accepted"], row["tokens"]) == (0, 0), row
    assert all(by_peer[p]["accepted"] >= 2 for p in honest), by_peer
    last = certs[-1]
    assert not riders & {e.peer_id for e in last.roster}  # never on the certified roster
    trusted = trusted_peers(manifest, last)
    assert trusted is not None and not riders & trusted


def test_four_free_riders_from_version_0_never_sit_earn_nothing_and_the_run_certifies(
    tmp_path: Path,
) -> None:
    """The young-run attack: four riders present from the start (version 0 has no update, so
    their first send is for v1), with the run's default trust rules."""
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(3)]
        run_id = net.publish_run(keys, work=WORK)
        nodes: list[NodeProc] = []

        def start_nodes() -> list[NodeProc]:  # once the riders' DHT node is up
            nodes.extend(
                net.start_node(f"node{i}", k, until_version=100) for i, k in enumerate(keys)
            )
            return nodes

        report = ride(net, run_id, start_nodes, count=4, start=1, rounds=ROUNDS, timeout=420)
        net.wait_versions(report.until, nodes, 120)
    assert report.first_base <= 2  # they rode the young run
    check_outcome(nodes[0], run_id, net.manifest, keys, report)
