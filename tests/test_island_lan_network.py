"""A LAN island on real processes (issue 13 item 2): ``join --island lab --lan-island`` leads a
one-rank island and announces it in the DHT (a signed rendezvous record); a second host's
``join --island lab --lan-island --island-secret HEX`` finds it and serves as its member (rank 1,
gloo over TCP), while a host without the secret and a process with a wrong one are refused.
The leader takes it in at a send boundary, the certificates credit the leader as one learner
with both ranks' rows, and when the member is SIGKILLed the leader re-forms alone and goes on.
Loopback stands in for the LAN."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import NodeProc
from p2pdiloco.protocol.identity import Identity
from tests.netutil import wait_for
from tests.test_sync_network import SMALL, certificates

pytestmark = [pytest.mark.slow, pytest.mark.solo, pytest.mark.timeout(600)]

LAN = ("--island", "lab", "--lan-island")


def _credits(node: NodeProc, run_id: str, peer: str, after: int) -> list[tuple[int, int, int]]:
    return [
        (c.body.version, a.steps, a.tokens)
        for c in certificates(node, run_id)
        for a in c.body.accepted
        if a.peer_id == peer and c.body.version > after
    ]


def test_a_lan_island_forms_through_the_dht_grows_and_re_forms(tmp_path: Path) -> None:
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(2)]
        # H = 6: a stretch of the island's gloo steps at a quarter of the time took ~10 s at
        # H = 12, and this test waits out six rounds; what it asserts does not depend on H.
        run_id = net.publish_run(keys, inner_steps=6)
        lead = net.start_node("lead", keys[0], until_version=100, extra=LAN)
        other = net.start_node("other", keys[1], until_version=100)
        net.wait_versions(1, [lead, other], 300)
        assert "island lab: leading; members join at 127.0.0.1:" in lead.text()

        out = lead.text()
        address = re.search(r"members join at (\S+)", out)
        secret = re.search(r"--island-secret ([0-9a-f]{64})", out)
        assert address is not None and secret is not None

        # A host of the LAN without the secret is told so in one line, before it joins.
        stranger = net.start_node("hostC", Identity.generate(), until_version=100, extra=LAN)
        assert stranger.proc.wait(120) != 0
        assert "its members need its secret: pass --island-secret" in stranger.text()
        # A process that reaches the store with a wrong secret is refused and logged.
        intruder = subprocess.Popen(
            [sys.executable, "-m", "p2pdiloco.island.member", f"--store={address[1]}",
             "--secret-stdin"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            assert intruder.stdin is not None
            intruder.stdin.write(b"ab" * 32 + b"\n")
            intruder.stdin.close()
            wait_for(
                "the leader to refuse the intruder",
                lambda: "refused a member" in lead.text(), 180,
            )  # fmt: skip
            assert "island_auth_failed" in lead.text()

            host_b = net.start_node(
                "hostB", Identity.generate(), until_version=100,
                extra=(*LAN, "--island-secret", secret[1]),
            )  # fmt: skip
            wait_for(
                "the leader to take host B in", lambda: "island now 2 ranks" in lead.text(), 180
            )
        finally:
            intruder.kill()
            intruder.wait(30)
            assert intruder.stdout is not None
            told = intruder.stdout.read().decode()
        assert "rank" not in told  # it never sat in a generation
        grown_at = lead.status()["version"]
        assert "as a member (gloo, 1 ranks now)" in host_b.text()
        assert "generation 1: rank 1 of 2" in host_b.text()

        per_step = net.manifest.inner.batch_size * net.manifest.inner.seq_len
        me = keys[0].peer_id
        wait_for(
            "a credit for the 2-rank island", lambda: _credits(lead, run_id, me, grown_at), 180
        )
        for _, steps, tokens in _credits(lead, run_id, me, grown_at):
            assert tokens == steps * per_step  # one learner, both ranks' rows

        host_b.proc.send_signal(signal.SIGKILL)
        host_b.proc.wait()
        killed_at = other.status()["version"]
        t0 = time.monotonic()
        wait_for(
            "the leader to re-form alone",
            lambda: "island re-formed with 1 ranks" in lead.text(),
            120,
        )
        print(f"re-formed {time.monotonic() - t0:.1f} s after the kill (version {killed_at})")
        wait_for(
            "a credit after the member is gone",
            lambda: _credits(lead, run_id, me, killed_at + 1),
            180,
        )
        assert "Traceback" not in lead.text()
