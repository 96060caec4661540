"""The bootstrap's observable surface in process: event lines, aggregated noise, and the web
page served over HTTP on loopback (parsed with the stdlib HTML parser)."""

from __future__ import annotations

import hashlib
import json
import logging
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from p2pdiloco.core.ledger import ChainFollower, build_ledger
from p2pdiloco.net.bootstrap import read_gossip
from p2pdiloco.net.cert_records import cert_topic, run_of_cert_topic
from p2pdiloco.net.gossip import GossipMessage
from p2pdiloco.net.http_api import HTTPApi
from p2pdiloco.net.observe import NetworkWatch, NoiseFilter
from p2pdiloco.net.web_page import render_page
from p2pdiloco.protocol.certificates import (
    Accepted,
    CertificateBody,
    assemble,
    roster_digest,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from tests.test_certificates import RUN as CERT_RUN
from tests.test_ledger import LEARNERS as CHAIN_LEARNERS
from tests.test_ledger import MANIFEST, honest_chain, receipt, successor
from tests.test_ledger import RUN_ID as CHAIN_RUN

RUN = CHAIN_RUN
P1, P2, P3 = ("12D3KooW" + c * 44 for c in "abc")
EVIL = '<script>alert("x")</script>'


def peer(pid: str, version: int, tps: float = 1500.0, island: str = "home") -> dict[str, Any]:
    return {
        "peer_id": pid,
        "run_id": RUN,
        "island": island,
        "roles": ["learner"],
        "reachability": "direct",
        "version": version,
        "throughput_tps": tps,
        "last_seen_s": 1.0,
    }


def state(*peers: dict[str, Any]) -> dict[str, Any]:
    return {
        "time": 1.8e9,
        "runs": [
            {
                "run_id": RUN,
                "name": "demo",
                "model": "gemma-tiny",
                "peers": len(peers),
                "latest_version": max((p["version"] for p in peers), default=0),
                "throughput_tps": sum(p["throughput_tps"] for p in peers),
                "incompatible": None,
            }
        ],
        "peers": list(peers),
        "bootstraps": [],
        "rejected_records": [],
    }


def self_certified(key: Identity, version: int, forger: str, salt: int = 0) -> bytes:
    """A certificate of ``version`` signed by a committee of ``key`` alone (quorum 1), crediting
    ``forger`` with 10^15 tokens: every signature it names is valid."""
    digest = hashlib.sha256(b"%d/%d" % (version, salt)).hexdigest()
    body = CertificateBody(
        run=RUN, version=version, base_version=version - 1, state_hash="ee" * 32,
        committee=[key.peer_id], quorum=1,
        accepted=[Accepted(peer_id=forger, digest=digest, steps=1, tokens=10**15)],
        roster_hash=roster_digest([]),
    )  # fmt: skip
    return assemble(body, {key.peer_id: sign_body(key, body)})


def test_noise_is_one_line_then_one_summary_per_period() -> None:
    now = [0.0]
    f = NoiseFilter(period=60.0, clock=lambda: now[0])

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("libp2p.transport.tcp", logging.ERROR, "x", 1, msg, (), None)

    assert f.filter(rec("Failed to open TCP stream: [Errno 111] 0.0.0.0:4001"))
    passed = [f.filter(rec("Failed to open TCP stream: refused")) for _ in range(71)]
    assert not any(passed)
    assert f.filter(rec("peer joined"))  # anything else passes untouched
    now[0] = 61.0
    summary = rec("Failed to open TCP stream: last one")
    assert f.filter(summary)
    assert summary.getMessage().startswith("72 connection errors in the last 61 s (latest: ")


def test_events_one_line_each_and_only_the_verified_chain_is_a_certified_version() -> None:
    empty = NetworkWatch()
    assert empty.update({**state(), "runs": []}) == ["watching 0 run(s) with 0 live peer(s)"]
    assert empty.update(state()) == [f"run published: demo ({RUN[:12]})"]
    watch = NetworkWatch()
    watch.follow(RUN, MANIFEST)
    assert watch.update(state(peer(P1, 0))) == ["watching 1 run(s) with 1 live peer(s)"]
    assert watch.update(state(peer(P1, 0), peer(P2, 0))) == [
        f"peer …{P2[-8:]} joined run demo (direct, island home)"
    ]
    assert watch.update(state(peer(P1, 99), peer(P2, 99))) == []  # announced, not certified
    assert watch.version(RUN) == 0 and watch.unheard(RUN) == [1, 2, 3, 4]  # what to fetch
    watch.add_certificates(RUN, [c.raw for c in reversed(honest_chain(3))])
    assert watch.update(state(peer(P1, 3), peer(P2, 3))) == [
        "run demo: version 3 certified (chain verified)"
    ]
    assert watch.update(state(peer(P2, 3))) == [f"peer …{P1[-8:]} left run demo"]
    assert watch.update(state(peer(P2, 3))) == []


def test_forged_certificates_and_announcements_leave_version_and_board_as_the_chain_says() -> None:
    # Twenty throw-away keys each certify one version (5 to 24) with a committee of itself,
    # crediting one forger with 10^15 tokens; two more announce version 10^6. A 21st forges
    # version 4, where the chain would grow next. None of it counts.
    chain = honest_chain(3)
    forger = Identity.generate().peer_id
    forged = [self_certified(Identity.generate(), v, forger) for v in range(4, 25)]
    watch = NetworkWatch()
    watch.follow(RUN, MANIFEST)
    watch.update(state(peer(P1, 0)))
    watch.add_certificates(RUN, forged + [c.raw for c in chain] + forged)
    lines = watch.update(state(peer(P1, 3), peer(P2, 10**6), peer(P3, 10**6)))
    assert lines[-1] == "run demo: version 3 certified (chain verified)"
    assert watch.version(RUN) == 3 and not watch.counted(RUN, 4)
    board = {r["peer_id"]: r["tokens"] for r in watch.leaderboard(RUN)}
    assert board == {
        e.peer_id: e.tokens for e in build_ledger(RUN, MANIFEST, [c.raw for c in chain]).entries
    }
    assert forger not in board
    assert watch.unheard(RUN) == [4, 5, 6, 7]  # fetched from the announcers, lowest first


def test_a_certificate_flood_holds_bounded_memory() -> None:
    watch = NetworkWatch()
    watch.follow(RUN, MANIFEST)
    key = Identity.generate()
    flood = [self_certified(key, 2 + i % 300, key.peer_id, salt=i) for i in range(2_000)]
    watch.add_certificates(RUN, flood)
    follower = watch._chains[RUN]
    waiting = [c for certs in follower.pending.values() for c in certs]
    assert len(waiting) <= 256 * ChainFollower.PER_VERSION
    assert follower.pending_bytes() <= ChainFollower.PENDING_BYTES
    assert len(follower.ignored) <= ChainFollower.MAX_IGNORED
    watch.add_certificates(RUN, [honest_chain(1)[0].raw])  # version 1 verifies; 2 is forged
    assert watch.version(RUN) == 1 and 2 not in follower.pending
    for run in range(NetworkWatch.MAX_RUNS + 10):  # a manifest flood: a bounded set of runs
        watch.follow(f"{run:064x}", MANIFEST)
    assert len(watch._chains) == NetworkWatch.MAX_RUNS


class Tables(HTMLParser):
    """Tables by id → rows of cell texts; every start tag seen."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.tags: list[str] = []
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag == "table":
            self._table = dict(attrs).get("id") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def test_web_page_served_at_root_shows_runs_peers_throughput_and_leaderboard() -> None:
    st = state(peer(P1, 4, 1200.0, island=EVIL), peer(P2, 4, 800.0))
    st["server"] = {"peer_id": P3, "version": "0.1.0", "uptime_s": 12.0}
    st["runs"][0]["certified_version"] = 4  # the verified chain's, never the peers' claims
    st["leaderboards"] = {RUN: [
        {"rank": 1, "peer_id": P1, "accepted": 3, "tokens": 6144, "share": 0.75},
        {"rank": 2, "peer_id": P2, "accepted": 1, "tokens": 2048, "share": 0.25},
    ]}  # fmt: skip
    api = HTTPApi(
        "127.0.0.1",
        0,
        healthy=lambda: True,
        state=lambda: st,
        registry=CollectorRegistry(),
        page=render_page,
    )
    api.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{api.port}/", timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
            body = r.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{api.port}/api/v1/state", timeout=10) as r:
            assert json.loads(r.read())["peers"][0]["island"] == EVIL  # same data, as JSON
    finally:
        api.close()
    page = Tables()
    page.feed(body)
    assert "script" not in page.tags and "<script>" not in body
    assert "&lt;script&gt;" in body
    runs = page.tables["runs"]
    assert runs[0] == ["run", "name", "model", "peers", "certified", "tokens/s", "note"]
    assert runs[1][:6] == [RUN[:12], "demo", "gemma-tiny", "2", "4", "2000"]
    peers = {row[0]: row for row in page.tables["peers"][1:]}
    assert peers[f"…{P1[-8:]}"][3] == EVIL  # shown as text, never as markup
    assert peers[f"…{P1[-8:]}"][6] == "1200" and peers[f"…{P2[-8:]}"][6] == "800"
    board = page.tables[f"leaderboard-{RUN[:12]}"]
    assert board[1] == ["1", f"…{P1[-8:]}", "3", "6,144", "75.0%"]
    assert P3 in body  # the bootstrap's own id in the header


def test_a_bootstrap_and_a_node_on_one_machine_have_their_own_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from p2pdiloco.net.bootstrap import BootstrapConfig, BootstrapServer
    from p2pdiloco.protocol.identity import Identity, default_identity_path

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    node = Identity.load_or_create(default_identity_path())
    server = BootstrapServer(BootstrapConfig())  # nothing starts before start()
    assert server.identity_path == tmp_path / "p2pdiloco" / "bootstrap.key"
    assert server.identity.peer_id != node.peer_id
    assert BootstrapServer(BootstrapConfig()).identity.peer_id == server.identity.peer_id  # kept


def test_the_leaderboard_counts_certificates_heard_on_gossip() -> None:
    # A round of 100 inputs has a certificate over a DHT record (16 KiB): gossip brings it.
    accepted = [receipt(CHAIN_LEARNERS[i % 3], 1000, i) for i in range(100)]
    raw = successor(None, accepted).raw
    assert len(raw) > 16 * 1024
    heard = [
        GossipMessage(cert_topic(RUN), raw, "p"),
        GossipMessage(cert_topic(RUN), raw, "p"),  # the same version again: counted once
        GossipMessage(f"p2pdiloco/v1/run/{RUN}", raw, "p"),  # not the certificate topic
        GossipMessage(cert_topic(RUN), b"junk", "p"),
        GossipMessage(cert_topic(CERT_RUN), raw, "p"),  # a run this bootstrap does not follow
    ]
    gossip = SimpleNamespace(get=lambda timeout: heard.pop(0) if heard else None)
    watch = NetworkWatch()
    watch.follow(RUN, MANIFEST)
    read_gossip(gossip, watch)  # type: ignore[arg-type]
    board = {row["peer_id"]: row for row in watch.leaderboard(RUN)}
    assert {p: (r["accepted"], r["tokens"]) for p, r in board.items()} == {
        CHAIN_LEARNERS[0]: (34, 34_000),
        CHAIN_LEARNERS[1]: (33, 33_000),
        CHAIN_LEARNERS[2]: (33, 33_000),
    }
    assert watch.leaderboard(CERT_RUN) == []
    assert run_of_cert_topic(cert_topic(CERT_RUN)) == CERT_RUN
    assert run_of_cert_topic(f"p2pdiloco/v1/run/{CERT_RUN}") is None
    assert run_of_cert_topic("p2pdiloco/v1/run/../certs") is None
