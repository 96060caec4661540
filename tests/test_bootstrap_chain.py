"""A bootstrap's page counts only the certified chain (issue 44): forged certificates stored in
a real DHT by throw-away keys, and heartbeats announcing a version nobody certified, leave the
run's version and leaderboard as the chain says."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.core.ledger import build_ledger
from p2pdiloco.net import keys
from p2pdiloco.net.bootstrap import BootstrapConfig, BootstrapServer
from p2pdiloco.net.cert_records import publish_certificate
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.net.manifests import publish_manifest
from p2pdiloco.net.web_page import render_page
from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import Hardware, Heartbeat
from p2pdiloco.protocol.signing import seal
from tests.netutil import wait_for
from tests.test_bootstrap_observe import Tables, self_certified
from tests.test_ledger import BY_ID, MANIFEST, MANIFEST_RAW, RUN_ID, honest_chain

pytestmark = [pytest.mark.timeout(300)]


def heartbeat(identity: Identity, version: int) -> bytes:
    hb = Heartbeat(
        peer_id=identity.peer_id, island="island", roles=["learner"],
        hardware=Hardware(device="cpu", name="cpu", memory_gb=1.0, count=1),
        throughput_tps=1.0, version=version, addrs=[], gossip_addrs=[], reachability="direct",
        seq=1,
    )  # fmt: skip
    return seal(identity, "heartbeat", RUN_ID, hb.model_dump(mode="json"))


def test_forged_certificates_in_the_dht_and_inflated_announcements_change_nothing(
    tmp_path: Path,
) -> None:
    chain = honest_chain(3)
    forger = Identity.generate().peer_id
    cfg = BootstrapConfig(host="127.0.0.1", port=0, http_host="127.0.0.1", http_port=0,
                          identity=tmp_path / "boot.key", refresh_interval=3600.0)  # fmt: skip
    with BootstrapServer(cfg) as server:
        writer = Identity.generate()
        with DHTPlane(writer, initial_peers=server.multiaddrs(), host="127.0.0.1") as dht:
            publish_manifest(dht, RUN_ID, MANIFEST, MANIFEST_RAW)
            # The honest chain, each version stored by another of its signers (the DHT keeps
            # one certificate per peer: its newest).
            for i, cert in enumerate(chain):
                signer = BY_ID[sorted(cert.signers)[i]]
                publish_certificate(signer, RUN_ID, cert, dht, None)
            # Twenty throw-away keys, each a committee of itself, certify versions 5 to 24.
            for version in range(5, 25):
                key = Identity.generate()
                forged = parse_certificate(self_certified(key, version, forger), run_id=RUN_ID)
                publish_certificate(key, RUN_ID, forged, dht, None)
            # An honest peer announces 3; two keys announce a million.
            honest, liars = Identity.generate(), [Identity.generate() for _ in range(2)]
            for who, version in [(honest, 3), *((liar, 10**6) for liar in liars)]:
                dht.store(keys.run_peers_key(RUN_ID), who.peer_id, heartbeat(who, version),
                          keys.HEARTBEAT_TTL)  # fmt: skip

            def polled() -> bool:
                server._refresh()
                st = server.state()
                return (
                    bool(st["runs"])
                    and len(st["peers"]) == 3
                    and st["runs"][0]["certified_version"] == 3
                )

            wait_for(
                "the bootstrap reads the run, its certificates and peers", polled, 60, interval=1.0
            )
        state = server.state()
        run = state["runs"][0]
        assert run["certified_version"] == 3  # never the announced 10^6
        board = {r["peer_id"]: r["tokens"] for r in state["leaderboards"][RUN_ID]}
        ledger = build_ledger(RUN_ID, MANIFEST, [c.raw for c in chain])
        assert board == {e.peer_id: e.tokens for e in ledger.entries}
        assert forger not in board
        page = Tables()
        page.feed(render_page(state))
        assert page.tables["runs"][1][4] == "3"
        shares = [row[4] for row in page.tables[f"leaderboard-{RUN_ID[:12]}"][1:]]
        assert "100.0%" not in shares
