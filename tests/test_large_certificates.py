"""Receipts that scale (ADR 0047): a round of 10,000 inputs is proposed, signed and certified,
and its 1.7 MB certificate crosses real hivemind streams, where a reply used to stop at 1 MiB."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.p2p import P2P

from p2pdiloco.core.round_types import MIN_HELD, held_cap
from p2pdiloco.net.bootstrap import BootstrapConfig, BootstrapServer, fetch_unheard, unheard
from p2pdiloco.net.cert_records import fetch_cert, publish_certificate
from p2pdiloco.net.gossip_limits import MAX_MESSAGE_BYTES
from p2pdiloco.net.observe import NetworkWatch
from p2pdiloco.net.sync_rpc import RpcError, serve
from p2pdiloco.net.transport import P2PTransport
from p2pdiloco.protocol.certificates import (
    MAX_CERTIFICATE_BYTES,
    MAX_RECEIPTS,
    MAX_REFUSALS,
    Accepted,
    Certificate,
    CertificateBody,
    Rejected,
    assemble,
    parse_certificate,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.sync.committee_msgs import (
    MAX_PROPOSAL_BYTES,
    BadMessage,
    open_proposal,
    open_signature,
    request_limits,
    seal_proposal,
    signature_message,
)
from p2pdiloco.testing.memnet import MemoryNetwork
from tests.test_certificates import LEARNERS, RUN, SYNCERS, body
from tests.test_ledger import LEARNERS as CHAIN_LEARNERS
from tests.test_ledger import MANIFEST as CHAIN_MANIFEST
from tests.test_ledger import RUN_ID as CHAIN_RUN
from tests.test_ledger import receipt, successor
from tests.test_runtime_memory import check_chains

INPUTS = 10_000


def _digests(n: int) -> list[str]:
    return sorted(hashlib.sha256(i.to_bytes(4, "big")).hexdigest() for i in range(n))


def _big_body() -> CertificateBody:
    who = [s.peer_id for s in LEARNERS]
    return body(
        accepted=[
            Accepted(peer_id=who[i % 3], digest=d, steps=500, tokens=500 * 2048)
            for i, d in enumerate(_digests(INPUTS))
        ]
    )


def _certificate(b: CertificateBody) -> bytes:
    return assemble(b, {s.peer_id: sign_body(s, b) for s in SYNCERS})


def _big_certificate() -> bytes:
    return _certificate(_big_body())


def test_a_certificate_at_every_bound_fits_its_byte_limit() -> None:
    # ADR 0047: MAX_RECEIPTS receipts with the largest claims, MAX_REFUSALS refusals with
    # reasons of 200 four-byte characters, 64 members who all sign: under MAX_CERTIFICATE_BYTES.
    digests = _digests(MAX_RECEIPTS + MAX_REFUSALS)
    who = [s.peer_id for s in LEARNERS]
    accepted = [
        Accepted(peer_id=who[i % 3], digest=d, steps=10**9, tokens=10**15)
        for i, d in enumerate(digests[:MAX_RECEIPTS])
    ]
    refused = [
        Rejected(peer_id=who[i % 3], digest=d, reason="𝄞" * 200)
        for i, d in enumerate(digests[MAX_RECEIPTS:])
    ]
    members = [Identity.from_seed(bytes([i, 7]) * 16) for i in range(64)]
    b = body(accepted=accepted, rejected=refused, committee=[m.peer_id for m in members], quorum=43)
    raw = assemble(b, {m.peer_id: sign_body(m, b) for m in members})
    assert 6 * 2**20 < len(raw) <= MAX_CERTIFICATE_BYTES
    assert len(parse_certificate(raw, run_id=RUN).body.accepted) == MAX_RECEIPTS
    with pytest.raises(ValueError, match="at most 16384"):
        body(accepted=[*accepted, Accepted(peer_id=who[0], digest="f" * 64, steps=1, tokens=1)])


def test_a_proposal_of_every_input_a_certificate_lists_is_accepted_and_one_more_is_not() -> None:
    leader = SYNCERS[0]
    full = tuple(_digests(MAX_RECEIPTS))
    raw = seal_proposal(leader, RUN, 8, 0, full)
    assert len(raw) <= MAX_PROPOSAL_BYTES
    assert len(open_proposal(raw, RUN).digests) == MAX_RECEIPTS
    over = seal_proposal(leader, RUN, 8, 0, tuple(_digests(MAX_RECEIPTS + 1)))
    with pytest.raises(BadMessage):
        open_proposal(over, RUN)


def test_a_signature_message_carries_a_body_of_ten_thousand_receipts() -> None:
    b = _big_body()
    msg = signature_message(SYNCERS[1].peer_id, b, sign_body(SYNCERS[1], b))
    assert 1 << 20 < len(msg) <= request_limits(1 << 20)["sign"][0]
    signer, got, _ = open_signature(msg)
    assert signer == SYNCERS[1].peer_id and len(got.accepted) == INPUTS


def test_a_certificate_over_a_mebibyte_is_fetched_over_real_streams() -> None:
    raw = _big_certificate()
    assert len(raw) > 1 << 20  # 1.7 MB: the reply limit before ADR 0047 refused it

    async def handler(
        op: str, peer: str, control: dict[str, Any], frames: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        assert op == "cert" and control.get("version") == 8
        return {"version": 8}, [raw]

    async def go() -> tuple[bytes, str]:
        opts: dict[str, Any] = dict(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            nat_port_map=False,
            auto_nat=False,
            use_relay=False,
        )
        server, client = await P2P.create(**opts), await P2P.create(**opts)
        try:
            await serve(server, handler, request_limits(1 << 20))
            addrs = [str(a) for a in await server.get_visible_maddrs()]
            me = client.peer_id.to_base58()
            transport = P2PTransport(client, me, lambda _peer: addrs)
            got = await fetch_cert(transport, server.peer_id.to_base58(), 8)
            try:  # what a caller with the old 1 MiB reply limit hears
                await transport.call(server.peer_id.to_base58(), "cert", args={"version": 8})
                old = "fetched"
            except RpcError as e:
                old = str(e)
            return got, old
        finally:
            await client.shutdown()
            await server.shutdown()

    got, old = asyncio.run(go())
    assert got == raw and old != "fetched"


def test_a_certificate_goes_on_gossip_and_in_the_dht_only_where_it_fits() -> None:
    published: list[int] = []
    stored: list[int] = []
    gossip = SimpleNamespace(alive=True, publish=lambda _topic, data: published.append(len(data)))
    dht = SimpleNamespace(store=lambda _key, _sub, record, _ttl: stored.append(len(record)))
    small = _certificate(body())
    big = _certificate(_big_body())
    for raw in (small, big):
        cert = parse_certificate(raw, run_id=RUN)
        publish_certificate(SYNCERS[0], RUN, cert, dht, gossip)  # type: ignore[arg-type]
    assert published == [len(small)] and len(big) > MAX_MESSAGE_BYTES  # the big one: `cert`
    assert len(stored) == 1  # only the small one fits a DHT record


def test_nodes_follow_versions_that_gossip_cannot_carry(tmp_path: Path) -> None:
    # Certificates over a gossip message (rounds of over about 1,400 inputs) are never
    # gossiped; nodes that train nothing and sit on no committee must still follow the chain,
    # fetching each certificate from the peers whose heartbeats announce its version.
    async def main() -> None:
        net = MemoryNetwork(tmp_path, nodes=6, committee_size=4, learners=4)
        net.directory.gossip_max = 0
        async with net:
            await net.wait_for(lambda: net.min_version() >= 3, 180, "version 3 everywhere")
            check_chains(net)
            # Members hold as many inputs as their memory allows for the run's payload.
            services = [n.runtime.service for n in net.nodes if n.runtime.service is not None]
            rounds = [(s, s.round) for s in services if s.round is not None]
            assert rounds
            for svc, rnd in rounds:
                cap = held_cap(svc.intake.max_payload)
                assert rnd.params.max_inputs == cap and MIN_HELD < cap < MAX_RECEIPTS

    asyncio.run(main())


def _chain_to_big() -> list[Certificate]:
    """A chain the bootstrap verifies from genesis: versions 1 to 7 of three receipts each, then
    version 8, a round of ``INPUTS`` receipts (1.7 MB)."""
    chain: list[Certificate] = []
    for v in range(1, 8):
        chain.append(
            successor(chain[-1] if chain else None, [receipt(p, 100, v) for p in CHAIN_LEARNERS])
        )
    big = [Accepted(peer_id=CHAIN_LEARNERS[i % 3], digest=d, steps=500, tokens=500 * 2048)
           for i, d in enumerate(_digests(INPUTS))]  # fmt: skip
    chain.append(successor(chain[-1], big))
    return chain


def _following(chain: list[Certificate]) -> NetworkWatch:
    """A watch that follows the chain's run and has counted all but its last version."""
    watch = NetworkWatch()
    watch.follow(CHAIN_RUN, CHAIN_MANIFEST)
    watch.add_certificates(CHAIN_RUN, [c.raw for c in chain[:-1]])
    assert watch.version(CHAIN_RUN) == len(chain) - 1
    return watch


def test_a_bootstrap_fetches_the_certificates_gossip_cannot_carry_for_its_leaderboard() -> None:
    # A 10,000-receipt certificate (1.7 MB) is neither in the DHT nor on gossip: the bootstrap
    # asks the peers that announce its version, newest first. The first serves a certificate
    # of another version (refused, one try lost); the second serves it and the board counts it.
    # The first also announces version 9 and serves a forged one for it: fetched, never counted.
    chain = _chain_to_big()
    raw = chain[-1].raw
    other = _certificate(body(run=CHAIN_RUN, version=9, base_version=8))
    assert len(raw) > MAX_MESSAGE_BYTES

    def serving(cert: bytes) -> Any:
        async def handler(
            op: str, peer: str, control: dict[str, Any], frames: list[bytes]
        ) -> tuple[dict[str, Any], list[bytes]]:
            assert op == "cert"
            return {"version": control.get("version")}, [cert]

        return handler

    async def go() -> tuple[Any, list[tuple[str, bytes]], NetworkWatch]:
        opts: dict[str, Any] = dict(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            nat_port_map=False,
            auto_nat=False,
            use_relay=False,
        )
        liar, honest, boot = [await P2P.create(**opts) for _ in range(3)]
        try:
            await serve(liar, serving(other), request_limits(1 << 20))
            await serve(honest, serving(raw), request_limits(1 << 20))
            addrs = {
                p.peer_id.to_base58(): [str(a) for a in await p.get_visible_maddrs()]
                for p in (liar, honest)
            }
            ids = list(addrs)
            peers = [dict(run_id=CHAIN_RUN, peer_id=pid, version=v, reachability="direct",
                          island="i") for pid, v in zip(ids, (9, 8), strict=True)]  # fmt: skip
            state = {"runs": [{"run_id": CHAIN_RUN, "name": "big"}], "peers": peers}
            watch = _following(chain)
            watch.update(state)
            wanted = unheard(watch, state)
            transport = P2PTransport(boot, boot.peer_id.to_base58(), lambda p: addrs.get(p, []))
            return wanted, await fetch_unheard(transport, wanted), watch
        finally:
            for p in (liar, honest, boot):
                await p.shutdown()

    wanted, got, watch = asyncio.run(go())
    assert [(v, len(holders)) for _, v, holders in wanted] == [(8, 2), (9, 1)]  # lowest first
    assert got == [(CHAIN_RUN, raw), (CHAIN_RUN, other)]  # 8 from the second peer
    for run_id, cert in got:
        watch.add_certificates(run_id, [cert])
    assert sum(row["accepted"] for row in watch.leaderboard(CHAIN_RUN)) == INPUTS + 7 * 3
    assert watch.counted(CHAIN_RUN, 8) and watch.unheard(CHAIN_RUN) == [9]
    assert watch.version(CHAIN_RUN) == 8 and not watch.counted(CHAIN_RUN, 9)  # 9 is forged


def test_a_running_bootstrap_fetches_them_beside_its_polls_and_counts_them(tmp_path: Path) -> None:
    # The server's own wiring: a real DHT and bridge; the fetch runs on the bridge's loop and
    # the next poll counts what it brought.
    chain = _chain_to_big()
    raw = chain[-1].raw

    async def handler(
        op: str, peer: str, control: dict[str, Any], frames: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        return {"version": 8}, [raw]

    cfg = BootstrapConfig(
        host="127.0.0.1",
        port=0,
        http_host="127.0.0.1",
        http_port=0,
        identity=tmp_path / "boot.key",
        refresh_interval=3600.0,
    )
    with BootstrapServer(cfg) as server:
        assert server.bridge is not None
        server.watch = _following(chain)
        holder = server.bridge.run(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), 30)
        try:
            server.bridge.run(serve(holder, handler, request_limits(1 << 20)), 10)
            addrs = [str(a) for a in server.bridge.run(holder.get_visible_maddrs(), 10)]
            state = {"runs": [{"run_id": CHAIN_RUN, "name": "big"}],
                     "peers": [dict(run_id=CHAIN_RUN, peer_id=holder.peer_id.to_base58(), version=8,
                                    addrs=addrs, reachability="direct", island="i")]}  # fmt: skip
            server.watch.update(state)
            server._fetch_unheard(state)  # starts the fetch, returns at once
            fetching = server._fetching
            assert fetching is not None and len(fetching.result(timeout=60)) == 1
            counted = sum(row["accepted"] for row in server.watch.leaderboard(CHAIN_RUN))
            assert counted == 7 * 3  # the fetch is counted by the poll, not by itself
            server._fetch_unheard(state)
            counted = sum(row["accepted"] for row in server.watch.leaderboard(CHAIN_RUN))
            assert counted == INPUTS + 7 * 3
        finally:
            server.bridge.run(holder.shutdown(), 10)
