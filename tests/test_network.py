"""The network plane with real processes on loopback: bootstrap, nodes, attackers.

Every node and bootstrap is a real `p2pdiloco` process with its own hivemind p2pd daemon and
py-libp2p gossip child; the test process reads the DHT with a client node of its own.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2pdiloco.net import keys, known_peers
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.net.discovery import collect_state
from p2pdiloco.net.gossip import GossipProcess
from p2pdiloco.net.gossip_limits import MEND_INTERVAL
from p2pdiloco.net.manifests import create_manifest, publish_manifest
from p2pdiloco.node import run_topic
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import Hardware, Heartbeat, run_id_of_body
from p2pdiloco.protocol.signing import PROTOCOL_VERSION, seal
from tests.netutil import Proc, free_port, peers_of, wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

FAST = ["--heartbeat-interval", "1", "--heartbeat-ttl", "6"]
IMPERSONATION = "heartbeat peer_id differs from its signer"


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def start_bootstrap(
    tmp: Path, name: str = "bootstrap", port: int = 0, http_port: int = 0
) -> tuple[Proc, str, int]:
    http_port = http_port or free_port()
    proc = Proc(
        name,
        [
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(http_port),
            "--identity",
            str(tmp / "bootstrap.key"),
        ],
        tmp,
    )
    out = proc.wait_output("HTTP:", timeout=60)
    addr = next(ln.strip() for ln in out.splitlines() if ln.startswith("  /ip4/"))
    return proc, addr, http_port


def node_id(proc: Proc, timeout: float = 60) -> str:
    """Wait for the node's "joined run NAME (ID) as PEER" line; its peer id."""
    out = proc.wait_output(" as 12D3KooW", timeout=timeout)
    match = re.search(r"joined run \S+ \(\w+\) as (\S+)", out)
    assert match, out[-2000:]
    return match.group(1)


def start_node(tmp: Path, name: str, bootstrap: str, *extra: str) -> Proc:
    proc = Proc(
        name,
        [
            "join",
            "--model",
            "gemma-tiny",
            "--bootstrap",
            bootstrap,
            "--host",
            "127.0.0.1",
            "--no-tui",
            "--no-train",
            "--island",
            name,
            *FAST,
            *extra,
        ],
        tmp,
    )
    return proc


@pytest.fixture()
def net(tmp_path: Path) -> Iterator[dict]:
    """A bootstrap server, a published gemma-tiny run and a DHT client for reading state."""
    yield from _network(tmp_path)


@pytest.fixture(scope="module")
def shared_net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The same, shared by the tests that only add records of their own (each its own run id
    or model key, none kills a process): one bootstrap start-up instead of one per test."""
    yield from _network(tmp_path_factory.mktemp("shared-net"))


def _network(tmp_path: Path) -> Iterator[dict]:
    boot, addr, http_port = start_bootstrap(tmp_path)
    client = DHTPlane(Identity.generate(), initial_peers=[addr], client_mode=True)
    run_id, manifest, raw = create_manifest(
        Identity.generate(),
        name="net-test",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=20,
        committee_size=4,
    )
    publish_manifest(client, run_id, manifest, raw)
    procs: list[Proc] = [boot]
    yield {
        "tmp": tmp_path,
        "boot": boot,
        "addr": addr,
        "http": http_port,
        "client": client,
        "run_id": run_id,
        "procs": procs,
    }
    client.close()
    for p in procs:
        p.stop(timeout=20)


def live_peers(net: dict) -> set[str]:
    return peers_of(collect_state(net["client"]).to_dict(), net["run_id"])


def test_bootstrap_answers_http_on_its_documented_ports(tmp_path: Path) -> None:
    """The operator's command from the docs, on its documented ports, started whole (no
    zygote). How long it takes to answer is a figure, not an assertion: docs/benchmarks.md."""
    t0 = time.monotonic()
    proc = Proc(
        "bootstrap",
        ["bootstrap", "--port", "31337", "--http-port", "8080", "--identity", str(tmp_path / "k")],
        tmp_path,
        fork=False,
    )
    try:
        status, _ = wait_for(
            "/healthz 200",
            lambda: (r := http_get("http://127.0.0.1:8080/healthz"))[0] == 200 and r,
            90,
        )
        code, body = http_get("http://127.0.0.1:8080/api/v1/state")
        print(f"\nbootstrap answered /api/v1/state {time.monotonic() - t0:.1f} s after spawn")
        assert code == 200
        state = json.loads(body)
        assert {"runs", "peers", "server"} <= set(state)
        out = proc.wait_output("/p2p/", timeout=5)
        assert "/tcp/31337/p2p/12D3KooW" in out
        code, metrics = http_get("http://127.0.0.1:8080/metrics")
        assert code == 200 and b"p2pdiloco_peers" in metrics
        code, page = http_get(
            "http://127.0.0.1:8080/"
        )  # the web page (tests/test_bootstrap_observe)
        assert code == 200 and b'<table id="runs">' in page and b'<table id="peers">' in page
        assert http_get("http://127.0.0.1:8080/nope")[0] == 404
    finally:
        assert proc.stop() == 0


def test_three_nodes_see_each_other_and_a_killed_node_drops_out(net: dict) -> None:
    nodes = [start_node(net["tmp"], f"node{i}", net["addr"]) for i in range(3)]
    net["procs"].extend(nodes)
    t0 = time.monotonic()
    ids = {node_id(n) for n in nodes}
    wait_for("3 peers in status", lambda: live_peers(net) >= ids, timeout=20)
    seen_after = time.monotonic() - t0
    # The CLI agrees with the in-process reader.
    status = Proc("status", ["status", "--bootstrap", net["addr"], "--json"], net["tmp"])
    status.proc.wait(timeout=60)
    state = json.loads(status.out.read_text())
    assert peers_of(state, net["run_id"]) >= ids
    assert state["runs"][0]["peers"] >= 3 and all(
        p["reachability"] == "direct" for p in state["peers"]
    )
    # Each node remembers the others for its next start (net.known_peers): node0's file names
    # node1 and node2 by their DHT addresses.
    key = net["tmp"] / "node0" / "p2pdiloco" / "identity.key"
    me = node_id(nodes[0])
    wait_for(
        "node0 to remember the other two",
        lambda: (
            {p.peer_id for p in known_peers.load(known_peers.known_peers_path(key), me)}
            == ids - {me}
        ),
        timeout=20,
    )

    victim = nodes[2]
    victim_id = node_id(victim)
    victim.kill()
    t_kill = time.monotonic()
    survivors = ids - {victim_id}

    def dropped_out() -> bool:  # one read: the victim gone and both survivors still there
        live = live_peers(net)
        return victim_id not in live and live >= survivors

    # A DHT read is a hint (one under load may miss a survivor's record); the claim is that one
    # read soon shows exactly the change, so both conditions are checked on the same read.
    wait_for("killed node to drop out, survivors still listed", dropped_out, timeout=6 + 15)
    dropped_after = time.monotonic() - t_kill
    nodes[0].wait_output(f"peer {victim_id[:16]} left", timeout=15)
    print(f"3 nodes visible after {seen_after:.1f}s; killed node gone after {dropped_after:.1f}s")


def test_bootstrap_restart_keeps_peer_id_and_nodes_reconnect(net: dict) -> None:
    node = start_node(net["tmp"], "node", net["addr"])
    net["procs"].append(node)
    nid = node_id(node)
    wait_for("node in status", lambda: nid in live_peers(net), timeout=20)
    boot = net["boot"]
    port = int(net["addr"].split("/tcp/")[1].split("/")[0])
    old_id = net["addr"].rsplit("/", 1)[1]
    assert boot.stop() == 0
    boot2, addr2, http2 = start_bootstrap(net["tmp"], "bootstrap2", port=port)
    net["procs"].append(boot2)
    assert addr2.rsplit("/", 1)[1] == old_id and f"/tcp/{port}/" in addr2

    def node_seen_by_restarted() -> bool:
        code, body = http_get(f"http://127.0.0.1:{http2}/api/v1/state")
        return code == 200 and nid in {p["peer_id"] for p in json.loads(body)["peers"]}

    wait_for("restarted bootstrap to see the node again", node_seen_by_restarted, timeout=45)
    assert node.alive()


def _heartbeat(
    ident: Identity, run_id: str, ts: float, seq: int = 1, peer_id: str | None = None
) -> bytes:
    hb = Heartbeat(
        peer_id=peer_id or ident.peer_id,
        island="attacker",
        roles=["learner"],
        hardware=Hardware(device="cpu", name="x", memory_gb=1.0, count=1),
        throughput_tps=0.0,
        version=0,
        addrs=[],
        gossip_addrs=[],
        reachability="unknown",
        seq=seq,
    )
    return seal(ident, "heartbeat", run_id, hb.model_dump(mode="json"), ts=ts)


def test_bad_records_are_rejected_and_logged_while_the_node_serves(net: dict) -> None:
    node = start_node(net["tmp"], "node", net["addr"])
    net["procs"].append(node)
    nid = node_id(node)
    run_id = net["run_id"]
    state = wait_for(
        "node's gossip address",
        lambda: next(
            (
                p
                for p in collect_state(net["client"]).to_dict()["peers"]
                if p["peer_id"] == nid and p["gossip_addrs"]
            ),
            None,
        ),
        timeout=20,
    )

    attacker = Identity.generate()
    now = time.time()
    forged = bytearray(_heartbeat(attacker, run_id, now))
    forged[forged.index(b'"island":"attacker"') + 10] ^= 0x01  # body changed after signing
    impersonation = _heartbeat(attacker, run_id, now + 0.5, peer_id=nid)
    newer, older = (
        _heartbeat(attacker, run_id, now + 2, seq=3),
        _heartbeat(attacker, run_id, now + 1, seq=2),
    )
    oversized = b"{" + b" " * 100_000 + b"}"

    with GossipProcess(attacker.seed, topics=[run_topic(run_id)]) as gossip:
        assert any(gossip.connect(a) for a in state["gossip_addrs"])

        def all_rejections_logged() -> bool:
            for payload in (bytes(forged), impersonation, oversized, newer, older):
                gossip.publish(run_topic(run_id), payload)
            text = node.text()
            return all(
                f"{attacker.peer_id} via gossip: {reason}" in text
                for reason in ("bad signature", "record too large", IMPERSONATION)
            )

        # A link that lost its subscription hello or its pubsub stream delivers again at the
        # next mend (the CI run that failed before mending: 30 s of messages held).
        wait_for(
            "node to log each rejected gossip record",
            all_rejections_logged,
            timeout=30 + 2 * MEND_INTERVAL,
            interval=1.0,
        )

    # DHT path: a heartbeat in the node's slot signed by someone else, and a malformed manifest.
    net["client"].store(
        keys.run_peers_key(run_id), nid, _heartbeat(attacker, run_id, time.time()), 30
    )
    bad_manifest = seal(
        attacker, "manifest", "", {"name": "evil", "protocol_version": PROTOCOL_VERSION}
    )
    assert not net["client"].store(keys.runs_key(), "f" * 64, bad_manifest, 60)
    boot = net["boot"]
    for code in ("wrong_slot", "malformed"):  # refused at store time, each with its code
        wait_for(
            f"bootstrap to refuse the record [{code}]",
            lambda c=code: f"DHT record from {attacker.peer_id} [{c}]" in boot.text() + node.text(),
            timeout=20,
        )
    assert not collect_state(net["client"]).to_dict()["rejected_records"]
    # The node kept serving throughout: still heartbeating, still alive.
    assert node.alive()
    t_before = time.time()
    wait_for(
        "a fresh heartbeat from the node",
        lambda: any(
            p["peer_id"] == nid and p["last_seen_s"] < 3
            for p in collect_state(net["client"]).to_dict()["peers"]
        ),
        timeout=15,
    )
    assert time.time() - t_before < 15
    assert "Traceback" not in node.text()


def test_with_gossip_disabled_nodes_converge_through_the_dht(net: dict) -> None:
    nodes = [start_node(net["tmp"], f"node{i}", net["addr"], "--no-gossip") for i in range(2)]
    net["procs"].extend(nodes)
    ids = {node_id(n) for n in nodes}
    for n in nodes:
        n.wait_output("peers 2", timeout=30)
        assert "gossip off" in n.text()
    assert live_peers(net) >= ids


def test_join_with_no_reachable_bootstrap_says_so_in_one_line(tmp_path: Path) -> None:
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{Identity.generate().peer_id}"
    proc = Proc(
        "node", ["join", "--model", "gemma-tiny", "--bootstrap", dead, "--no-tui"], tmp_path
    )
    proc.proc.wait(timeout=120)
    assert proc.proc.returncode == 2
    err = [ln for ln in proc.err.read_text().splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and dead in err[0] and "Traceback" not in proc.text()


def test_plain_hivemind_client_bootstraps_but_cannot_store_foreign_values(shared_net: dict) -> None:
    import hivemind
    from hivemind.utils import get_dht_time

    refused = shared_net["boot"].text().count("refused DHT record")
    plain = hivemind.DHT(initial_peers=[shared_net["addr"]], start=True, client_mode=True)
    try:
        assert plain.get("some/unrelated/key") is None  # routing through the bootstrap works
        stored = plain.store("some/unrelated/key", "junk", get_dht_time() + 60)
        assert stored is False  # the bootstrap refuses values that are not signed envelopes
    finally:
        plain.shutdown()
    wait_for(
        "the bootstrap to log the refusal",
        lambda: shared_net["boot"].text().count("refused DHT record") > refused,
        10,
    )


def test_join_refuses_a_manifest_of_another_protocol_version(shared_net: dict) -> None:
    creator = Identity.generate()
    body = {
        "protocol_version": PROTOCOL_VERSION + 1,
        "name": "future",
        "model": "gemma-small",
        "data": "embedded",
        "seed": 0,
        "creator": creator.peer_id,
        "created_at": time.time(),
        "committee_size": 4,
        "quorum": 3,
        "inner_steps": 20,
        "something_new": True,
    }
    raw = seal(creator, "manifest", "", body)
    run_id = run_id_of_body(json.loads(raw)["body"])  # its own hash, as every version's is
    assert shared_net["client"].store(keys.runs_key(), run_id, raw, 60)
    assert shared_net["client"].store(keys.model_runs_key("gemma-small"), run_id, raw, 60)
    proc = Proc(
        "future-node",
        [
            "join",
            "--model",
            "gemma-small",
            "--bootstrap",
            shared_net["addr"],
            "--host",
            "127.0.0.1",
        ],
        shared_net["tmp"],
    )
    proc.proc.wait(timeout=120)
    err = proc.err.read_text()
    assert proc.proc.returncode == 2, proc.text()[-2000:]
    assert f"protocol version {PROTOCOL_VERSION + 1}" in err and "upgrade" in err
    assert "Traceback" not in err


def test_join_refuses_a_manifest_this_build_cannot_honour(shared_net: dict) -> None:
    """A run naming a merge rule this build lacks is refused in one line, before training."""
    run_id, manifest, raw = create_manifest(
        Identity.generate(),
        name="exotic",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=20,
        committee_size=4,
        rules={"aggregation": "no-such-rule"},
    )
    publish_manifest(shared_net["client"], run_id, manifest, raw)
    proc = Proc(
        "exotic-node",
        [
            "join",
            "--run",
            run_id,
            "--bootstrap",
            shared_net["addr"],
            "--host",
            "127.0.0.1",
            "--no-tui",
            "--state-dir",
            str(shared_net["tmp"] / "exotic-state"),
            *FAST,
        ],
        shared_net["tmp"],
    )
    shared_net["procs"].append(proc)
    proc.proc.wait(timeout=120)
    err = proc.err.read_text()
    assert proc.proc.returncode == 2, proc.text()[-2000:]
    lines = [ln for ln in err.splitlines() if "no-such-rule" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]


def test_a_manifest_of_another_protocol_shows_as_incompatible_without_its_fields(
    shared_net: dict,
) -> None:
    """A body from another protocol is not validated: the state view shows only what is safe."""
    attacker = Identity.generate()
    body = {"name": "old", "protocol_version": PROTOCOL_VERSION - 1, "creator": attacker.peer_id}
    raw = seal(attacker, "manifest", "", body)
    assert shared_net["client"].store(
        keys.runs_key(), run_id_of_body(json.loads(raw)["body"]), raw, 60
    )
    state = wait_for(
        "the incompatible run listed",
        lambda: [
            r
            for r in collect_state(shared_net["client"]).to_dict()["runs"]
            if r["incompatible"] and r["name"] == "old"
        ],
        timeout=20,
    )
    assert state[0]["name"] == "old" and state[0]["protocol_version"] == PROTOCOL_VERSION - 1
