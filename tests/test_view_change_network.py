"""View change on real processes: a committee that loses two of its four syncers (SIGKILL, as a
crash) hands the version to the next view's committee, and the survivors keep certifying.

Asserted: the guarantees (the certificate of the next version comes from a later view and
carries the proof that the earlier views timed out, every chain verifies from genesis, the
survivors keep training), never one schedule's timing: the wait is bounded per view.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.demo import LocalNetwork
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.sync.fetch import verify_next
from p2pdiloco.sync.roster import committee_for
from tests.test_sync_network import SMALL, certificates

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VIEW_TIMEOUT = 30.0  # > grace (15) + agree_timeout (5): the manifest refuses less


def test_two_killed_syncers_of_four_hand_the_version_to_the_next_view(tmp_path: Path) -> None:
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(6)]
        run_id = net.publish_run(keys, view_timeout=VIEW_TIMEOUT)  # k = 4, quorum 3
        nodes = [net.start_node(f"node{i}", k, until_version=8) for i, k in enumerate(keys)]
        net.wait_versions(2, nodes, 400)
        chain = certificates(nodes[0], run_id)
        base = chain[-1]
        info = committee_for(run_id, net.manifest, base)
        victims = [n for n in nodes if n.identity.peer_id in info.members[:2]]
        tokens_before = {n.name: n.status().get("tokens_trained", 0) for n in nodes}
        for n in victims:
            n.kill()  # the leader and the next member of the next version's committee
        survivors = [n for n in nodes if n not in victims]
        # View 0 cannot reach its quorum of 3 with two of four dead: a later view certifies.
        net.wait_versions(base.body.version + 2, survivors, 2 * (VIEW_TIMEOUT + 120))

        chain = certificates(survivors[0], run_id)
        nxt = next(c for c in chain if c.body.version == base.body.version + 1)
        assert nxt.body.view >= 1 and len(nxt.views) == nxt.body.view
        prev = None
        for cert in chain:  # every certificate verifies from genesis, views included
            prev = verify_next(run_id, net.manifest, prev, cert.raw)
        for n in survivors:
            assert n.status().get("tokens_trained", 0) > tokens_before[n.name]  # kept training
            assert "Traceback" not in n.text()
