"""Remembered peers: a node restarted while every bootstrap server is down joins through them."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from p2pdiloco.net import known_peers
from p2pdiloco.net.dht import DHTPlane, NetworkError
from p2pdiloco.net.discovery import read_runs
from p2pdiloco.net.known_peers import KnownPeer
from p2pdiloco.net.manifests import create_manifest, publish_manifest
from p2pdiloco.protocol.identity import Identity
from tests.netutil import wait_for

A = "12D3KooWA"
B = "12D3KooWB"
ME = "12D3KooWMe"


def addr(peer: str, port: int = 4001) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}"


def test_the_most_recent_usable_peers_are_kept_and_read_back(tmp_path: Path) -> None:
    path = known_peers.known_peers_path(tmp_path / "key")
    assert path == tmp_path / "key.peers.json"
    peers = [
        KnownPeer(A, (addr(A), f"/ip4/1.2.3.4/tcp/1/p2p/R/p2p-circuit/p2p/{A}"), 10.0),
        KnownPeer(B, (addr(A),), 20.0),  # an address of another peer: unusable, dropped
        KnownPeer(ME, (addr(ME),), 30.0),  # never ourselves
        *[KnownPeer(f"12D3KooWP{i}", (addr(f"12D3KooWP{i}", i),), 100.0 + i) for i in range(12)],
    ]
    known_peers.save(path, peers, ME)
    got = known_peers.load(path, ME)
    assert len(got) == known_peers.MAX_PEERS
    assert [p.peer_id for p in got] == [f"12D3KooWP{i}" for i in range(11, 3, -1)]
    known_peers.save(path, peers[:2], ME)
    assert known_peers.load(path, ME) == [KnownPeer(A, (addr(A),), 10.0)]  # no relay address
    assert known_peers.initial_peers(["/boot", addr(A)], known_peers.load(path, ME)) == [
        "/boot",
        addr(A),
    ]


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[]",
        json.dumps({"format": 99, "peers": []}).encode(),
        json.dumps({"format": 1, "peers": [{"peer_id": A, "addrs": "x", "seen": 1}]}).encode(),
        json.dumps({"format": 1, "peers": [5]}).encode(),
        b" " * (known_peers.MAX_FILE_BYTES + 1),
    ],
)
def test_a_bad_file_is_ignored_with_one_warning(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "key.peers.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="p2pdiloco.net.known_peers"):
        assert known_peers.load(path, ME) == []
    assert len(caplog.records) == 1 and "ignoring the known-peers file" in caplog.text
    assert known_peers.load(tmp_path / "none.json", ME) == []  # no file yet: no warning
    assert len(caplog.records) == 1


def test_nothing_to_remember_leaves_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "key.peers.json"
    known_peers.save(path, [KnownPeer(ME, (addr(ME),), 1.0)], ME)
    assert not path.exists()


@pytest.mark.slow
def test_a_restart_with_every_bootstrap_down_joins_through_a_remembered_peer(
    tmp_path: Path,
) -> None:
    """Real DHT daemons on loopback: a bootstrap, a peer that joined through it, and a node
    that remembered that peer. With the bootstrap gone, the node's restart still joins and
    finds the run; without the remembered peer it cannot join at all."""
    boot = DHTPlane(Identity.generate(), host="127.0.0.1")
    boot_addr = boot.visible_maddrs()[0]
    peer = DHTPlane(Identity.generate(), initial_peers=[boot_addr], host="127.0.0.1")
    try:
        run_id, manifest, raw = create_manifest(
            Identity.generate(),
            name="remembered",
            model="gemma-tiny",
            data="embedded",
            seed=0,
            inner_steps=20,
            committee_size=4,
        )
        publish_manifest(peer, run_id, manifest, raw)
        me = Identity.generate()
        path = known_peers.known_peers_path(tmp_path / "key")
        known_peers.save(
            path, [KnownPeer(peer.peer_id, tuple(peer.visible_maddrs()), time.time())], me.peer_id
        )
        boot.close()  # every bootstrap server is down from here on

        with pytest.raises(NetworkError, match="cannot join the DHT"):
            DHTPlane(Identity.generate(), initial_peers=[boot_addr], host="127.0.0.1")

        remembered = known_peers.load(path, me.peer_id)
        assert [p.peer_id for p in remembered] == [peer.peer_id]
        initial = known_peers.initial_peers([boot_addr], remembered)
        with DHTPlane(me, initial_peers=initial, host="127.0.0.1") as dht:
            wait_for(
                "the run, read through the remembered peer",
                lambda: run_id in [r.run_id for r in read_runs(dht, "gemma-tiny")[0]],
                timeout=30,
            )
    finally:
        peer.close()
        boot.close()
