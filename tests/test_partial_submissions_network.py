"""Issue 10's first stuck round on real processes: submissions that reach one member only.

Committee k = q = 3. Before attempt-numbered leaders and the view change, two valid
submissions sent to one committee member only made it propose a set the others refused
("proposal from a syncer that is not the current leader"): the states split, 2 signatures
against 1, and the run was stuck for good. Here two extra identities send valid (zero) deltas to
one member only, for every version from 1 to 6 (``p2pdiloco.harness.sybil.flood`` with ``only``).

And the stuck round "one failed fetch during leader rotation": that member also refuses the
first two fetches asked of it (``P2PDILOCO_FAILPOINTS``, as dropped streams would). Before
fetches were retried, a follower that could not fetch an agreed input never signed, and with
k = q = 3 the version was stuck. Where the member leads, its followers now retry.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.sybil import flood
from p2pdiloco.protocol.identity import Identity
from tests.test_sync_network import SMALL, certificates

pytestmark = [pytest.mark.slow, pytest.mark.solo, pytest.mark.timeout(600)]

UNTIL = 6


def test_submissions_to_one_member_only_neither_split_nor_stall_the_committee(
    tmp_path: Path,
) -> None:
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(3)]
        # A young run throughout (trust out of reach): the extra deltas count like any other.
        run_id = net.publish_run(keys, trust_min_accepted=10**6)
        lonely = keys[2].peer_id
        nodes = [
            net.start_node(
                f"node{i}",
                k,
                until_version=UNTIL + 1,
                env={"P2PDILOCO_FAILPOINTS": "serve_fetch=2"} if k.peer_id == lonely else None,
            )
            for i, k in enumerate(keys)
        ]
        report = flood(net, run_id, nodes, count=2, start=1, until=UNTIL, scale=0.0, only=lonely)
        net.wait_versions(UNTIL, nodes, 300)
        texts = [n.text() for n in nodes]

    assert report.accepted >= 2, report.replies[:4]
    chains = [{c.body.version: c.body.state_hash for c in certificates(n, run_id)} for n in nodes]
    for v in range(1, UNTIL + 1):
        assert len({chain[v] for chain in chains}) == 1, f"states split at version {v}"
    certs = certificates(nodes[0], run_id)
    assert all(len(c.signers) >= c.body.quorum for c in certs)
    extra = set(report.sybils)
    led = [c.body.version for c in certs if c.body.committee[0] == lonely]
    fetched = sum(a.peer_id in extra for c in certs for a in c.body.accepted)
    views = {c.body.version: c.body.view for c in certs}
    print(
        f"the lonely member led versions {led}; {fetched} of its extra deltas were merged; "
        f"views {views}"
    )
    if fetched:  # it led a round with its extras: its followers' first fetches were refused
        assert texts[2].count("failpoint serve_fetch: failing here") == 2
    assert all("Traceback" not in t for t in texts)
