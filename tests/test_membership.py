"""Sans-IO membership table and reachability verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.net.membership import Membership
from p2pdiloco.net.reachability import classify
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import Hardware, Heartbeat
from p2pdiloco.protocol.signing import InvalidRecord, open_envelope, seal

RUN = "ab" * 32


def heartbeat(ident: Identity, ts: float, run: str = RUN, peer_id: str | None = None) -> bytes:
    hb = Heartbeat(
        peer_id=peer_id or ident.peer_id,
        island="i",
        roles=["learner"],
        hardware=Hardware(device="cpu", name="c", memory_gb=1.0, count=1),
        throughput_tps=1.0,
        version=0,
        addrs=[],
        gossip_addrs=[],
        reachability="direct",
        seq=int(ts),
    )
    return seal(ident, "heartbeat", run, hb.model_dump(mode="json"), ts=ts)


def env(raw: bytes):
    return open_envelope(raw, now=1e12, max_skew=1e12)


def test_duplicate_via_both_paths_is_silent_and_counted_once() -> None:
    a = Identity.generate()
    table = Membership(run_id=RUN, ttl=30)
    raw = heartbeat(a, 100.0)
    assert table.ingest(env(raw), via="gossip") is True
    assert table.ingest(env(raw), via="dht") is False
    view = table.peers[a.peer_id]
    assert view.seen_via == {"gossip", "dht"} and view.via == "gossip"
    assert [v.peer_id for v in table.live(now=110)] == [a.peer_id]


def test_newer_replaces_and_an_older_copy_is_ignored_not_rejected() -> None:
    """The DHT and gossip deliver one peer's heartbeats in any order: an older copy arriving
    after a newer one is normal operation, ignored without an error or a rejection."""
    a = Identity.generate()
    table = Membership(run_id=RUN, ttl=30)
    table.ingest(env(heartbeat(a, 100.0)), via="dht")
    assert table.ingest(env(heartbeat(a, 105.0)), via="gossip") is True
    assert table.ingest(env(heartbeat(a, 101.0)), via="dht") is False
    assert table.rejected == 0 and table.stale == 1
    assert table.peers[a.peer_id].ts == 105.0 and table.peers[a.peer_id].via == "gossip"


def test_two_heartbeats_for_one_instant_are_rejected() -> None:
    a = Identity.generate()
    table = Membership(run_id=RUN, ttl=30)
    table.ingest(env(heartbeat(a, 100.0)), via="dht")
    other = Heartbeat.model_validate(env(heartbeat(a, 100.0)).body).model_copy(update={"seq": 7})
    raw = seal(a, "heartbeat", RUN, other.model_dump(mode="json"), ts=100.0)
    with pytest.raises(InvalidRecord, match="conflicting") as exc:
        table.ingest(env(raw), via="gossip")
    assert exc.value.signer == a.peer_id and table.rejected == 1


def test_expiry_after_ttl() -> None:
    a, b = Identity.generate(), Identity.generate()
    table = Membership(run_id=RUN, ttl=10)
    table.ingest(env(heartbeat(a, 100.0)), via="dht")
    table.ingest(env(heartbeat(b, 108.0)), via="dht")
    assert {v.peer_id for v in table.live(now=109)} == {a.peer_id, b.peer_id}
    assert table.expire(now=111) == [a.peer_id]
    assert [v.peer_id for v in table.live(now=111)] == [b.peer_id]


def test_other_run_and_impersonation_are_rejected() -> None:
    a, b = Identity.generate(), Identity.generate()
    table = Membership(run_id=RUN, ttl=10)
    with pytest.raises(InvalidRecord, match="run"):
        table.ingest(env(heartbeat(a, 1.0, run="cd" * 32)), via="dht")
    with pytest.raises(InvalidRecord, match="differs from its signer"):
        table.ingest(env(heartbeat(a, 1.0, peer_id=b.peer_id)), via="gossip")
    errors = table.ingest_many(
        [(env(heartbeat(a, 2.0, run="cd" * 32)), "dht"), (env(heartbeat(a, 1.5)), "dht")]
    )
    assert len(errors) == 1 and a.peer_id in table.peers


def test_reachability_verdicts() -> None:
    assert classify([], [4001]).status == "unknown"
    direct = classify([{"observed_ip": "1.2.3.4", "reachable_ports": [4001]}], [4001])
    assert direct.status == "direct" and "1.2.3.4" in direct.detail
    relayed = classify([{"observed_ip": "1.2.3.4", "reachable_ports": []}], [4001, 4002])
    assert relayed.status == "relayed"
    assert "4001, 4002" in relayed.fix and "open or forward TCP port" in relayed.fix
    assert classify([{"error": "bad"}], [1]).status == "unknown"


def test_a_node_never_publishes_its_host_name_as_its_island(tmp_path: Path) -> None:
    import platform

    from p2pdiloco.node import Node, NodeConfig

    boot = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWAsa7ZiGkhWgeGvQnAU2A1sdCFVMWXxihKGxzhJE1nYbe"
    node = Node(NodeConfig(bootstrap=[boot], identity=tmp_path / "key"))  # nothing starts
    assert node.island == f"island-{node.me[-6:]}" and platform.node() not in node.island
    named = Node(NodeConfig(bootstrap=[boot], identity=tmp_path / "key", island="lab"))
    assert named.island == "lab"
