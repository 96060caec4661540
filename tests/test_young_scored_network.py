"""A young run that scores work, as the README walk makes it: one genesis member (ADR 0066).

Stop 49 walked the README with ``run create --score-work``: the creator's node alone was the
genesis committee, and a second volunteer's deltas were all refused ``round_closed`` (the
probation room next to one trusted learner was 0, and the round closed on the creator's delta),
so it never got into an input set, never earned a receipt, never became trusted. Here, on real
processes: the creator and a second ``join`` process; the run certifies on, and the second
learner's deltas reach the committee's input sets and are scored.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import WorkScoring
from tests.test_sync_network import SMALL, verified_certificates

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_scored_run_of_one_genesis_member_lets_a_second_learner_into_its_rounds(
    tmp_path: Path,
) -> None:
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        creator, newcomer = Identity.generate(), Identity.generate()
        run_id = net.publish_run([creator], work=WorkScoring().model_dump())
        assert net.manifest.genesis_committee == [creator.peer_id]
        nodes = [net.start_node("creator", creator, until_version=100)]
        net.wait_versions(1, nodes, 180)
        nodes.append(net.start_node("newcomer", newcomer, until_version=100))
        net.wait_versions(8, nodes, 360)
    certs = verified_certificates(nodes[0], run_id, net.manifest)
    assert [c.body.version for c in certs] == list(range(1, len(certs) + 1))
    joined = [
        c
        for c in certs
        if newcomer.peer_id
        in {a.peer_id for a in c.body.accepted} | {r.peer_id for r in c.body.rejected}
    ]
    assert joined, "the second learner's deltas never reached an input set"
