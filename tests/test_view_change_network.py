"""View change on real processes: a committee that loses two of its four syncers (SIGKILL, as a
crash) hands the version to the next view's committee, and the survivors keep certifying.

Asserted: the guarantees (the certificate of the next version comes from a later view and
carries the proof that the earlier views timed out, every chain verifies from genesis, the
survivors keep training), never one schedule's timing: the wait is bounded per view.

And the rejoin of issue 10: in a two-node run (k = q = 2) one node stops with Ctrl-C and comes
back after more than a view timeout; the run certifies on, both chains verify and agree. And an
elected late joiner that stops (k = q = 3).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from p2pdiloco.core.roster import committee_for, roster_of
from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import NodeProc
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.sync.fetch import verify_next
from tests.netutil import wait_for
from tests.test_sync_network import SMALL, certificates, verified_certificates

pytestmark = [pytest.mark.slow, pytest.mark.solo, pytest.mark.timeout(900)]

# Short rounds and views (the manifest refuses a view timeout under grace + agree_timeout):
# these tests wait out whole views, and the guarantees do not depend on the timings.
VIEW_TIMEOUT = 10.0
TIMING = {"grace": 5.0, "agree_timeout": 3.0, "view_timeout": VIEW_TIMEOUT}


def test_two_killed_syncers_of_four_hand_the_version_to_the_next_view(tmp_path: Path) -> None:
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(6)]
        # k = 4, quorum 3. Stretches of a 4 s time budget (H out of reach): "a learner never
        # stops for as long as a stretch" then means something on 2 busy cores, where the
        # scheduler alone stalls a process for up to ~2 s (1.82 s against an H = 12 stretch
        # of 1.65 s failed a CI run).
        run_id = net.publish_run(keys, inner_steps=10_000, time_budget=4.0, **TIMING)
        nodes = [net.start_node(f"node{i}", k, until_version=100) for i, k in enumerate(keys)]
        net.wait_versions(2, nodes, 400)
        everyone = {k.peer_id for k in keys}

        def newest_knowing_everyone() -> Any:
            # The newest certificate any node holds (one node may be a version behind), once
            # its roster knows all six: later views can seat only peers the certified roster
            # knows, and with just k of them two dead leave no live quorum, by design.
            newest = max(
                (verified_certificates(n, run_id, net.manifest)[-1] for n in nodes),
                key=lambda c: c.body.version,
            )
            known = {e.peer_id for e in roster_of(net.manifest, newest)}
            return newest if everyone <= known else None

        # Its committee for the next version loses two members within a fraction of a second.
        base = wait_for("every learner in the certified roster", newest_knowing_everyone, 300)
        info = committee_for(run_id, net.manifest, base)
        victims = [n for n in nodes if n.identity.peer_id in info.members[:2]]
        for n in victims:
            n.kill()  # the leader and the next member of the next version's committee
        killed_at = time.monotonic()
        tokens_before = {n.name: n.status().get("tokens_trained", 0) for n in nodes}
        survivors = [n for n in nodes if n not in victims]
        # View 0 cannot reach its quorum of 3 with two of four dead: a later view certifies.
        net.wait_versions(base.body.version + 1, survivors, 2 * (VIEW_TIMEOUT + 120))
        # A figure, not an assertion (timings are benchmarks): the issue asks for the view
        # timeout plus one round (a 4 s stretch, 5 s grace, 3 s agreement here).
        print(
            f"next version on every survivor {time.monotonic() - killed_at:.1f} s after "
            f"the kill (view timeout {VIEW_TIMEOUT:.0f} s)"
        )
        net.wait_versions(base.body.version + 2, survivors, 2 * (VIEW_TIMEOUT + 120))

        chain = certificates(survivors[0], run_id)
        nxt = next(c for c in chain if c.body.version == base.body.version + 1)
        # View 0 could certify only with a dead member's signature, sent before the kill landed.
        dead = {n.identity.peer_id for n in victims}
        assert nxt.body.view >= 1 or dead & set(nxt.signers), (nxt.body.view, nxt.signers)
        assert len(nxt.views) == nxt.body.view
        prev = None
        for cert in chain:  # every certificate verifies from genesis, views included
            prev = verify_next(run_id, net.manifest, prev, cert.raw)
        for n in survivors:  # kept training throughout: never a pause as long as a stretch
            st = n.status()
            assert st.get("tokens_trained", 0) > tokens_before[n.name]
            print(
                f"{n.name}: longest pause between chunks {st['longest_pause_s']} s, "
                f"stretch {st['stretch_s']} s"
            )
            assert st["longest_pause_s"] < st["stretch_s"]
            assert "Traceback" not in n.text()


def _verified_hashes(net: LocalNetwork, node: NodeProc, run_id: str) -> dict[int, str]:
    """Every certificate the node stored verifies from genesis; the state hash per version."""
    prev, out = None, {}
    for cert in certificates(node, run_id):
        prev = verify_next(run_id, net.manifest, prev, cert.raw)
        out[cert.body.version] = cert.body.state_hash
    return out


def test_a_node_back_after_a_view_timeout_does_not_freeze_a_two_node_run(tmp_path: Path) -> None:
    with LocalNetwork(tmp_path, SMALL, kill_on_exit=True) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(2)]
        run_id = net.publish_run(keys, **TIMING)  # k = q = 2: none may miss
        nodes = [net.start_node(f"node{i}", k, until_version=100) for i, k in enumerate(keys)]
        net.wait_versions(2, nodes, 300)
        away = nodes[1]
        vote = "voting to hand it to view"
        votes = nodes[0].text().count(vote)
        os.killpg(away.proc.pid, signal.SIGINT)  # Ctrl-C: a clean stop
        assert away.proc.wait(60) == 0
        left_at = max(int(n.status().get("version", 0)) for n in nodes)
        # Away for longer than a view: the one left timed a view out (and may vote again).
        wait_for(
            "a view timed out on the node left alone",
            lambda: nodes[0].text().count(vote) > votes,
            3 * VIEW_TIMEOUT + 60,
        )
        back = net.start_node("node1", keys[1], until_version=100)
        net.wait_versions(left_at + 2, [nodes[0], back], 2 * (VIEW_TIMEOUT + 120))

        first, second = (_verified_hashes(net, n, run_id) for n in (nodes[0], back))
        assert max(first) >= left_at + 2 and max(second) >= left_at + 2
        assert all(first[v] == second[v] for v in first.keys() & second.keys())
        for n in (nodes[0], back):
            assert "Traceback" not in n.text()


def test_an_elected_late_joiner_that_stops_does_not_stop_the_run(tmp_path: Path) -> None:
    """Issue 10's second stuck round: k = q = 3, a late joiner earns a seat (trust thresholds
    of one accepted delta and one version) and stops with Ctrl-C once a certificate has elected
    it. Before the view change, "sign to … failed (attempt 4)" and the run was stuck for good.
    Now the run certifies on (a later view when the joiner's signature was missing), every
    chain verifies from genesis, and no two nodes hold different states for one version."""
    with LocalNetwork(tmp_path, SMALL, kill_on_exit=True) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(3)]  # k = q = 3: no member may be missing
        # Short views: with q = k every view holding the stopped member fails, and the ranking
        # of a four-peer roster slides one seat per view, so up to three views time out.
        run_id = net.publish_run(keys, trust_min_accepted=1, trust_min_age=1, **TIMING)
        nodes = [net.start_node(f"node{i}", k, until_version=100) for i, k in enumerate(keys)]
        net.wait_versions(1, nodes, 300)
        joiner = Identity.generate()
        late = net.start_node("late", joiner, until_version=100)

        def elected() -> Any:
            certs = verified_certificates(nodes[0], run_id, net.manifest)
            seat = (
                certs and joiner.peer_id in committee_for(run_id, net.manifest, certs[-1]).members
            )
            return certs[-1] if seat else None

        base = wait_for("a certificate that elects the late joiner", elected, 400, interval=0.1)
        os.killpg(late.proc.pid, signal.SIGINT)  # Ctrl-C: the volunteer stops
        assert late.proc.wait(60) == 0
        v = base.body.version
        net.wait_versions(v + 1, nodes, 3 * VIEW_TIMEOUT + 240)

        chains = [_verified_hashes(net, n, run_id) for n in (*nodes, late)]
        for version in range(1, v + 2):
            assert len({c[version] for c in chains if version in c}) == 1, f"split at {version}"
        nxt = next(c for c in certificates(nodes[0], run_id) if c.body.version == v + 1)
        signed = joiner.peer_id in nxt.signers
        print(
            f"elected for version {v + 1}; certified in view {nxt.body.view}, "
            f"{'with' if signed else 'without'} the joiner's signature"
        )
        assert signed or nxt.body.view >= 1  # q = k: without it, only a later view certifies
        for n in (*nodes, late):
            assert "Traceback" not in n.text()
