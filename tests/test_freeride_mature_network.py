"""Issue 44's free riders arriving in a mature run, against real processes: two fresh
identities that replay the run's certified update (``p2pdiloco.harness.freeride``) once every
honest node has earned trust by receipts never sit on a committee, earn no receipt, token or
trust, and the honest nodes certify on (``tests/test_freeride_network.py`` says more). Before
ADR 0062 one such rider was trusted and seated at once and the run stalled in view changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.freeride import ride
from p2pdiloco.protocol.certificates import Certificate
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest
from tests.netutil import wait_for
from tests.test_freeride_network import ROUNDS, WORK, check_outcome
from tests.test_sync_network import SMALL, verified_certificates

pytestmark = [pytest.mark.slow, pytest.mark.solo, pytest.mark.timeout(600)]


def _earned(manifest: RunManifest, cert: Certificate) -> int:
    """Identities with trust earned by receipts on ``cert``'s roster (not the young-run rule)."""
    r = manifest.rules
    base = cert.body.version
    return sum(
        e.accepted >= r.trust_min_accepted and base - e.joined_version >= r.trust_min_age
        for e in cert.roster
    )


def test_two_free_riders_arriving_in_a_mature_run_never_sit_earn_nothing(
    tmp_path: Path,
) -> None:
    """The mature-run attack: two riders arrive once every honest node has earned trust by
    receipts under the run's default rules (3 receipts over 3 versions: from version 3 on
    when all three trained from the start)."""
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(3)]
        run_id = net.publish_run(keys, work=WORK)
        nodes = [net.start_node(f"node{i}", k, until_version=100) for i, k in enumerate(keys)]

        def mature() -> int | None:
            certs = verified_certificates(nodes[0], run_id, net.manifest)
            if certs and _earned(net.manifest, certs[-1]) >= len(keys):
                return certs[-1].body.version
            return None

        starts: list[int] = []

        def arrive() -> int:  # the riders get ready meanwhile, and announce from here on
            starts.append(wait_for("trust earned by every honest node", mature, 300))
            return starts[0]

        report = ride(net, run_id, nodes, count=2, start=arrive, rounds=ROUNDS, timeout=420)
        net.wait_versions(report.until, nodes, 120)
    assert report.first_base >= starts[0]
    check_outcome(nodes[0], run_id, net.manifest, keys, report)
