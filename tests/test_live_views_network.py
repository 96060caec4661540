"""Committees that fit the live network, on real processes (issue 39 item 1, ADR 0055).

Nodes are real ``p2pdiloco join`` processes (``p2pdiloco.harness.demo.LocalNetwork``) on
loopback, with a run made as ``run create`` makes it (k = 4, q = 3). Each test states the
outcome it proves; the bounds come from the protocol's view timeouts (the pacemaker's), never
from sleeps.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from p2pdiloco.core.roster import committee_for
from p2pdiloco.core.views import view_start
from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import DemoConfig, NodeProc
from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.protocol.identity import Identity
from tests.test_sync_network import verified_certificates

pytestmark = [pytest.mark.slow, pytest.mark.solo, pytest.mark.timeout(900)]

# As tests/test_sync_network.py's: rounds of a few seconds, nodes train a quarter of the time.
SMALL = DemoConfig(
    inner_steps=4, grace=8.0, agree_timeout=3.0, batch_size=2, seq_len=32, compute_share=0.25
)
UNTIL = 1000  # nodes never stop by themselves


def ctrl_c(node: NodeProc) -> None:
    """What a volunteer's Ctrl-C does: SIGINT to the process group; it saves and exits."""
    os.killpg(node.proc.pid, signal.SIGINT)
    node.proc.wait(60)


def version(node: NodeProc) -> int:
    return int(node.status().get("version", 0))


def next_version_within(
    net: LocalNetwork, survivors: list[NodeProc], base: int, bound: float
) -> float:
    """Seconds until every survivor holds version ``base`` + 1; fails past ``bound``."""
    start = time.monotonic()
    net.wait_versions(base + 1, survivors, bound)
    return time.monotonic() - start


def next_committee(net: LocalNetwork, node: NodeProc) -> tuple[int, tuple[str, ...]]:
    """The newest version ``node`` holds and view 0's committee of the version after it, leader
    first, from its chain verified from genesis."""
    cert = verified_certificates(node, net.run_id, net.manifest)[-1]
    return cert.body.version, committee_for(net.run_id, net.manifest, cert).members


def chain_is_one_history(net: LocalNetwork, nodes: list[NodeProc]) -> None:
    """Every certificate any node holds is the only one of its version (one content)."""
    seen: dict[int, str] = {}
    assert any((n.dir / "state" / "certs").glob("*.json") for n in nodes)
    for n in nodes:
        for p in sorted((n.dir / "state" / "certs").glob("*.json")):
            cert = parse_certificate(p.read_bytes(), run_id=net.run_id)
            assert seen.setdefault(cert.body.version, cert.body.state_hash) == cert.body.state_hash


def three_volunteers(net: LocalNetwork) -> tuple[list[Identity], list[NodeProc]]:
    net.start_bootstrap()
    keys = [Identity.generate() for _ in range(3)]
    # the run as `run create` signs it by default: k = 4, q = 3; three peers make a short
    # committee of 3 with the quorum of 2 that keeps the manifest's one absence (ADR 0055)
    net.publish_run(keys, committee_size=4, quorum=3)
    nodes = [net.start_node(f"node{i}", k, until_version=UNTIL) for i, k in enumerate(keys)]
    net.wait_versions(2, nodes, 300)
    return keys, nodes


@pytest.mark.parametrize("stop", ["ctrl-c", "sigkill"])
def test_one_of_three_volunteers_leaves_and_the_other_two_certify_within_one_view_timeout(
    tmp_path: Path, stop: str
) -> None:
    """Outcome: with one of three volunteers stopped (Ctrl-C, or SIGKILL as a crash), the two
    left certify the next version within one view timeout of the stop, and the one after it;
    before, the committee of 3 had a quorum of 3 and every view seated the departed member."""
    with LocalNetwork(tmp_path, SMALL) as net:
        _, nodes = three_volunteers(net)
        timeout = net.manifest.rules.view_timeout_s
        # the worst case: the one who leaves leads view 0 of the next version (its silence
        # costs that view; view 1 has another leader)
        _, members = next_committee(net, nodes[0])
        victim = next(n for n in nodes if n.identity.peer_id == members[0])
        survivors = [n for n in nodes if n is not victim]
        ctrl_c(victim) if stop == "ctrl-c" else victim.kill()
        base = max(version(n) for n in survivors)
        took = next_version_within(net, survivors, base, timeout)
        print(
            f"{stop}: version {base + 1} certified {took:.1f} s after, view timeout {timeout:.0f} s"
        )
        assert took <= timeout
        net.wait_versions(base + 2, survivors, 2 * timeout)
        chain_is_one_history(net, nodes)
        for n in survivors:
            assert "Traceback" not in n.text()


def test_two_of_five_volunteers_leave_at_once_and_the_three_left_certify_on(
    tmp_path: Path,
) -> None:
    """Outcome: five volunteers (k = 4, q = 3), one stopped with Ctrl-C and one SIGKILLed at
    the same moment. The three left certify the next version within the pacemaker's bound
    for four views (a view of 4 out of 5 leaves one candidate out: the windows move on until
    the one left out is a departed one; a view whose quorum is out of reach ends at once,
    ADR 0041), then on; one history."""
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(5)]
        net.publish_run(keys, committee_size=4, quorum=3)
        nodes = [net.start_node(f"node{i}", k, until_version=UNTIL) for i, k in enumerate(keys)]
        net.wait_versions(3, nodes, 400)
        rules = net.manifest.rules
        # the worst case: both sit on view 0 of the next version, one of them its leader
        _, members = next_committee(net, nodes[0])
        by_id = {n.identity.peer_id: n for n in nodes}
        ctrl_c_node, killed = by_id[members[0]], by_id[members[1]]
        os.killpg(ctrl_c_node.proc.pid, signal.SIGINT)
        killed.kill()
        ctrl_c_node.proc.wait(60)
        survivors = [n for n in nodes if n not in (ctrl_c_node, killed)]
        base = max(version(n) for n in survivors)
        bound = view_start(rules, 4) + rules.grace
        took = next_version_within(net, survivors, base, bound)
        print(f"two of five: version {base + 1} certified {took:.1f} s after, bound {bound:.0f} s")
        net.wait_versions(base + 2, survivors, bound)
        chain_is_one_history(net, nodes)
