"""A run outlives its bootstrap and its creator (issue 39, item 3), with real processes.

One bootstrap and volunteers on loopback (``harness.demo.LocalNetwork``): the bootstrap is
restarted empty (same key and port, a fresh process) while every volunteer is offline, and the
volunteers other than the creator resume from the signed manifest they kept on disk; or while
the volunteers are online, and they refill it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import DemoConfig, NodeProc
from p2pdiloco.net.cert_records import cert_version, read_certificates
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.net.discovery import read_runs
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.identity import Identity
from tests.netutil import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SMALL = DemoConfig(inner_steps=8, grace=20.0, batch_size=4, seq_len=64, committee_size=2)


def runs_in_dht(net: LocalNetwork) -> set[str]:
    """Run ids a fresh client finds through the bootstrap (its own DHT node: no cache)."""
    with DHTPlane(Identity.generate(), initial_peers=[net.boot_addr], client_mode=True) as dht:
        return {r.run_id for r in read_runs(dht)[0]}


def ctrl_c(nodes: list[NodeProc]) -> None:
    """A volunteer's Ctrl-C to each node at once; each stops cleanly (exit 0)."""
    for n in nodes:
        os.kill(n.proc.pid, signal.SIGINT)
    for n in nodes:
        assert n.exit_code(120) == 0, n.log_tail()
        assert "stopped cleanly" in n.text(), n.log_tail()


def kept_run(state_dir: Path, creator: Identity, seed: int) -> str:
    """A run's signed manifest kept in ``state_dir`` as a node keeps it, never published."""
    run_id, _, raw = create_manifest(
        creator,
        name="kept",
        model="gemma-tiny",
        data="embedded",
        seed=seed,
        inner_steps=8,
        committee_size=1,
        quorum=1,
    )
    state_dir.mkdir(parents=True)
    (state_dir / "manifest.json").write_bytes(raw)
    return run_id


def said(node: NodeProc, needle: str, timeout: float = 120) -> str:
    """The node's log once it contains ``needle``."""

    def probe() -> str | None:
        assert node.proc.poll() is None, node.log_tail()
        return text if needle in (text := node.text()) else None

    return wait_for(f"{node.name} to say {needle!r}", probe, timeout)


def joined(node: NodeProc, run_id: str) -> str:
    """The node's log once it printed its "joined run" line for ``run_id``."""
    return said(node, f"({run_id[:12]}) as")


def test_volunteers_resume_a_run_the_restarted_bootstrap_forgot(tmp_path: Path) -> None:
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(3)]
        run_id = net.publish_run(keys)  # keys[0] is the creator
        nodes = [net.start_node(f"node{i}", k, until_version=1) for i, k in enumerate(keys)]
        net.wait_versions(1, nodes, 300)
        ctrl_c(nodes)

        net.restart_bootstrap()
        assert runs_in_dht(net) == set(), "the restarted bootstrap should hold nothing"

        # The first to return finds nothing in the DHT: it resumes from the manifest on its
        # disk and publishes it again; the next finds it there (or on its own disk: either way
        # the run it kept).
        t0 = time.monotonic()
        by_model = net.start_node(
            "node2", keys[2], until_version=1, target=("--model", "gemma-tiny")
        )
        text = joined(by_model, run_id)
        assert f"no run for model 'gemma-tiny' in the DHT: resuming demo ({run_id[:12]})" in text
        by_id = net.start_node("node1", keys[1], until_version=1, target=("--run", run_id[:8]))
        joined(by_id, run_id)
        for n in (by_id, by_model):
            said(n, "resuming from certified version 1")
        resumed = time.monotonic() - t0

        # A new volunteer, nothing on disk, finds the run in the DHT the two refilled, and
        # catches up to the version they hold.
        newcomer = net.start_node(
            "node3", Identity.generate(), until_version=1, target=("--model", "gemma-tiny")
        )
        text = joined(newcomer, run_id)
        assert "in the DHT:" not in text  # found in the DHT, not on its (empty) disk
        net.wait_versions(1, [newcomer], 180)
        with DHTPlane(Identity.generate(), initial_peers=[net.boot_addr], client_mode=True) as dht:
            assert {r.run_id for r in read_runs(dht)[0]} == {run_id}
            versions = [cert_version(raw) for raw in read_certificates(dht, run_id)]
        assert versions and max(versions) >= 1, "the resumed nodes store their certificates again"
        for n in (by_id, by_model, newcomer):
            assert "Traceback" not in n.text(), n.log_tail()
        print(f"\nresumed after a bootstrap restart: both joined {resumed:.1f} s after start")


def test_a_bootstrap_restarted_empty_is_refilled_within_a_heartbeat_interval(
    tmp_path: Path,
) -> None:
    interval = 2.0
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(2)]
        run_id = net.publish_run(keys)
        flags = ["--no-train", "--heartbeat-interval", str(interval)]
        nodes = [
            net.start_node(f"node{i}", k, until_version=1, extra=flags) for i, k in enumerate(keys)
        ]
        for n in nodes:
            joined(n, run_id)

        net.restart_bootstrap()
        t0 = time.monotonic()
        wait_for("the run in the DHT again", lambda: run_id in runs_in_dht(net), 30, 0.1)
        refilled = time.monotonic() - t0
        # Every volunteer gone at once: what a fresh client finds now, the bootstrap holds.
        for n in nodes:
            n.kill()
        assert runs_in_dht(net) == {run_id}
        print(f"\nrestarted bootstrap refilled {refilled:.1f} s after it was up")
        # One interval for the members' next tick (rejoin, then store), plus a fresh client's
        # start-up (about 1 s) and a loaded machine's lag.
        assert refilled < interval + 6.0


def test_join_takes_a_run_the_dht_never_had_from_its_manifest_on_disk(tmp_path: Path) -> None:
    """Without training (``--no-train``): ``join --run PREFIX`` and ``join --model NAME`` with
    the signed manifest kept in ``--state-dir``, against a bootstrap that never heard of the
    run; each publishes it, and a volunteer with nothing on disk then finds it by id."""
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(2)]
        run_a = kept_run(tmp_path / "a" / "state", keys[0], seed=1)
        kept_run(tmp_path / "b" / "state", keys[1], seed=2)
        flags = ["--no-train"]
        t0 = time.monotonic()
        a = net.start_node("a", keys[0], until_version=1, target=("--run", run_a[:8]), extra=flags)
        text = joined(a, run_a)
        assert f"run '{run_a[:8]}' is not in the DHT: joining kept ({run_a[:12]})" in text
        assert str(tmp_path / "a" / "state" / "manifest.json") in text
        took = time.monotonic() - t0
        # b kept another run of the model, but the DHT has one (a's): the DHT's is chosen, and
        # a kept run only when the DHT has none (tested above).
        b = net.start_node(
            "b", keys[1], until_version=1, target=("--model", "gemma-tiny"), extra=flags
        )
        assert "in the DHT:" not in joined(b, run_a)
        newcomer = net.start_node(
            "c", Identity.generate(), until_version=1, target=("--run", run_a[:8]), extra=flags
        )
        assert "in the DHT:" not in joined(newcomer, run_a)
        print(f"\njoin --run from disk: joined {took:.1f} s after start")
