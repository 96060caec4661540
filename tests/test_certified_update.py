"""Compressed certified updates (ADR 0029): a node one version behind downloads the round's
encoded merged pseudo-gradient instead of the state, applies the outer step itself and reaches
exactly the certified state; anything that does not match falls back to the full download.

Real gemma-tiny tensors and real committee signatures, in process; the last test runs whole
nodes over the in-memory transport (``testing/memnet.py``)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pdiloco.compress.wire import pack_deltas
from p2pdiloco.core.roster import committee_for, with_roster
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.net.sync_rpc import RpcRefused
from p2pdiloco.net.transport import MemoryHub
from p2pdiloco.protocol.certificates import Certificate, assemble, parse_certificate, sign_body
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest, SyncRules
from p2pdiloco.runtime.chain import ChainStore
from p2pdiloco.sync.aggregator import MergeInput, merge_round
from p2pdiloco.sync.certified import CertifiedState, apply_update, genesis_state, next_state
from p2pdiloco.sync.committee_msgs import body_of, request_limits
from p2pdiloco.sync.fetch import SyncError, download_state, follow_update, follow_updates
from p2pdiloco.sync.rules import UnsupportedManifest, check_supported
from p2pdiloco.sync.update import UpdateError, hash_update, pack_update, update_codec
from p2pdiloco.train.configs import OuterConfig

KEYS = [Identity.from_seed(hashlib.sha256(b"update%d" % i).digest()) for i in range(4)]
BY_ID = {k.peer_id: k for k in KEYS}
OUTER = OuterConfig(lr=0.7, momentum=0.9)


def make_run(update_codec: str = "int8") -> tuple[str, RunManifest]:
    run_id, manifest, _ = create_manifest(
        KEYS[0],
        name="update",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=4,
        committee_size=4,
        compression="int8",
        genesis_committee=[k.peer_id for k in KEYS],
        rules={"aggregation": "mean", "update_codec": update_codec},
    )
    return run_id, manifest


@pytest.fixture(scope="module")
def genesis() -> CertifiedState:
    return genesis_state(make_run()[1])


def round_inputs(base: CertifiedState, seed: int = 0, m: int = 3) -> list[MergeInput]:
    g = torch.Generator().manual_seed(seed)
    return [
        MergeInput(
            f"{i:02x}" * 32,
            KEYS[i].peer_id,
            {n: 1e-3 * torch.randn(t.shape, generator=g) for n, t in base.params.items()},
            1.0,
        )
        for i in range(m)
    ]


def certify(
    run_id: str,
    manifest: RunManifest,
    base: CertifiedState,
    state: CertifiedState,
    inputs: list[MergeInput],
    update_hash: str | None,
) -> Certificate:
    """The committee's certificate of ``state`` on ``base``, signed by all four members."""
    committee = committee_for(run_id, manifest, base.cert)
    senders = {i.digest: (i.peer_id, 4, 4 * 64) for i in inputs}
    body = body_of(
        run_id,
        manifest,
        base.version,
        base.cert,
        committee,
        state.state_hash,
        senders,
        [i.digest for i in inputs],
        {},
        0,
        update_hash,
    )
    sigs = {p: sign_body(BY_ID[p], body) for p in body.committee}
    return with_roster(manifest, base.cert, parse_certificate(assemble(body, sigs), run_id=run_id))


@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "int4"])
def test_applying_the_certified_update_reaches_exactly_the_certified_state(
    genesis: CertifiedState, codec: str
) -> None:
    run_id, manifest = make_run(codec)
    inputs = round_inputs(genesis)
    result, state = next_state(genesis, inputs, manifest.rules, OUTER)
    assert state.update is not None and len(result.accepted) == 3
    cert = certify(run_id, manifest, genesis, state, inputs, state.update_hash)
    assert cert.body.update_hash == hash_update(state.update)
    got = apply_update(genesis, cert, state.update, manifest.rules, OUTER)
    assert got.state_hash == cert.body.state_hash and got.version == 1
    for n in state.params:
        assert torch.equal(got.params[n], state.params[n])
        assert torch.equal(got.momentum[n], state.momentum[n])
    numel = sum(t.numel() for t in genesis.params.values())
    per_param = {"none": 4, "fp16": 2, "int8": 1.01, "int4": 0.6}[codec]
    assert len(state.update) < per_param * numel + 65536  # payload plus header
    assert len(state.update) < genesis.blob().index.total_bytes / 1.9  # vs params + momentum


def test_the_update_pack_is_the_delta_pack_of_the_merged_update(genesis: CertifiedState) -> None:
    rules = make_run("int8")[1].rules
    result = merge_round(
        genesis.params,
        genesis.momentum,
        round_inputs(genesis),
        rules=rules,
        outer=OUTER,
        update_codec=update_codec("int8"),
    )
    want = pack_deltas(dict(sorted(result.update.items())))
    assert pack_update(result.update) == want and not result.update  # consumed as packed


def test_the_none_update_codec_certifies_the_states_of_before(genesis: CertifiedState) -> None:
    """fp32 g stepped as decoded is g stepped as merged: the certified states (and their
    hashes) are bit for bit those of the merge without an update codec."""
    inputs = round_inputs(genesis, seed=3)
    _, state = next_state(genesis, inputs, SyncRules(aggregation="mean"), OUTER)
    plain = merge_round(
        genesis.params, genesis.momentum, inputs, rules=SyncRules(aggregation="mean"), outer=OUTER
    )
    assert state.state_hash == CertifiedState(1, None, plain.params, plain.momentum).state_hash


def test_honest_syncers_make_bit_identical_int8_updates(genesis: CertifiedState) -> None:
    rules = make_run("int8")[1].rules
    threads = torch.get_num_threads()
    made = []
    try:
        for n_threads in (1, 2):  # two syncers, one input set, different thread counts
            torch.set_num_threads(n_threads)
            made.append(next_state(genesis, round_inputs(genesis, seed=7), rules, OUTER)[1])
    finally:
        torch.set_num_threads(threads)
    a, b = made
    assert a.update == b.update and a.state_hash == b.state_hash


def test_an_update_that_is_not_the_certified_one_is_refused(genesis: CertifiedState) -> None:
    run_id, manifest = make_run()
    inputs = round_inputs(genesis)
    _, state = next_state(genesis, inputs, manifest.rules, OUTER)
    assert state.update is not None
    cert = certify(run_id, manifest, genesis, state, inputs, state.update_hash)
    flipped = bytearray(state.update)
    flipped[-1] ^= 1
    with pytest.raises(UpdateError) as e:
        apply_update(genesis, cert, bytes(flipped), manifest.rules, OUTER)
    assert e.value.code is Reason.DIGEST_MISMATCH
    # Committee-signed, but the update hash names other bytes than the state was made with:
    # the served update cannot match it, and a matching one would fail the state hash.
    other = next_state(genesis, round_inputs(genesis, seed=1), manifest.rules, OUTER)[1]
    assert other.update is not None
    wrong = certify(run_id, manifest, genesis, state, inputs, other.update_hash)
    with pytest.raises(UpdateError) as e:
        apply_update(genesis, wrong, state.update, manifest.rules, OUTER)
    assert e.value.code is Reason.DIGEST_MISMATCH
    with pytest.raises(UpdateError) as e:
        apply_update(genesis, wrong, other.update, manifest.rules, OUTER)
    assert e.value.code is Reason.STATE_MISMATCH


def test_a_sparse_update_codec_is_refused_in_one_line() -> None:
    with pytest.raises(UnsupportedManifest) as e:
        check_supported(make_run("topk2")[1])
    msg = str(e.value)
    assert "\n" not in msg and "topk2" in msg and "error feedback" in msg and "int8" in msg
    check_supported(make_run("int8")[1])


def serving(
    hub: MemoryHub,
    tmp_path: Path,
    peer: str,
    run_id: str,
    *states: CertifiedState,
    corrupt: bool = False,
) -> None:
    """``peer`` serves ``states`` as a node's chain does; ``corrupt``: a flipped update byte."""
    chain = ChainStore(tmp_path / peer[-8:], run_id)
    for s in states:
        chain.install(s)

    async def handler(op: str, _peer: str, control: dict[str, Any], _frames: list[bytes]) -> Any:
        if op not in ("cert", "index", "chunk", "update"):
            raise RpcRefused(Reason.UNKNOWN_OP, op)
        reply, out = chain.serve(op, control)
        if corrupt and op == "update" and control.get("i") == 0:
            out = [bytes([out[0][0] ^ 1]) + out[0][1:]]
        return reply, out

    hub.handlers[peer] = (handler, request_limits(1 << 20), None)


def follow(
    hub: MemoryHub,
    manifest: RunManifest,
    base: CertifiedState,
    cert: Certificate,
    peers: list[str],
) -> tuple[CertifiedState, str]:
    """What the runtime does (``NodeRuntime._apply_locked``): the update, else the state."""

    async def main() -> tuple[CertifiedState, str]:
        me = hub.transport("learner")
        try:
            return (await follow_update(me, manifest, base, cert, peers))[0], "update"
        except (SyncError, UpdateError):
            return (await download_state(me, cert, peers)).state, "full"

    return asyncio.run(main())


def certified_round(
    genesis: CertifiedState, seed: int = 0
) -> tuple[str, RunManifest, list[MergeInput], CertifiedState, Certificate]:
    """Version 1 on ``genesis``: the run, the round's inputs, the state and its certificate."""
    run_id, manifest = make_run()
    inputs = round_inputs(genesis, seed=seed)
    _, state = next_state(genesis, inputs, manifest.rules, OUTER)
    state.cert = cert = certify(run_id, manifest, genesis, state, inputs, state.update_hash)
    return run_id, manifest, inputs, state, cert


def test_a_learner_downloads_the_update_and_a_liar_is_skipped(
    genesis: CertifiedState, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_id, manifest, _, state, cert = certified_round(genesis)
    hub = MemoryHub()
    liar, honest = KEYS[1].peer_id, KEYS[2].peer_id
    serving(hub, tmp_path, liar, run_id, genesis, state, corrupt=True)
    serving(hub, tmp_path, honest, run_id, genesis, state)
    with caplog.at_level(logging.WARNING, logger="p2pdiloco.sync.fetch"):
        got, how = follow(hub, manifest, genesis, cert, [liar, honest])
    assert how == "update" and got.state_hash == cert.body.state_hash
    assert any(liar in r.message and "digest_mismatch" in r.message for r in caplog.records)
    assert got.update == state.update  # and it can serve the update on
    # Bytes counted at the transport: the update is a fraction of the state it replaces.
    state_bytes = genesis.blob().index.total_bytes
    assert hub.received["learner"] < 2 * len(state.update) + 4096 < state_bytes / 2


def test_only_liars_or_a_wrong_update_hash_fall_back_to_the_full_state(
    genesis: CertifiedState, tmp_path: Path
) -> None:
    run_id, manifest, inputs, state, cert = certified_round(genesis)
    hub = MemoryHub()
    liar = KEYS[1].peer_id
    serving(hub, tmp_path, liar, run_id, genesis, state, corrupt=True)
    got, how = follow(hub, manifest, genesis, cert, [liar])
    assert how == "full" and got.state_hash == cert.body.state_hash
    # A committee-signed certificate whose update hash matches no update: the update cannot be
    # verified, the node downloads the state, and the state hash decides.
    bogus = certify(run_id, manifest, genesis, state, inputs, "ab" * 32)
    hub2 = MemoryHub()
    honest = KEYS[2].peer_id
    serving(hub2, tmp_path, honest, run_id, genesis, state)
    got, how = follow(hub2, manifest, genesis, bogus, [honest])
    assert how == "full" and got.state_hash == bogus.body.state_hash


def corrupt_updates(hub: MemoryHub, peers: list[str]) -> None:
    """Every update ``peers`` serve from now on has its first byte flipped."""
    for peer in peers:
        handler, limits, screen = hub.handlers[peer]

        async def lying(
            op: str, src: str, control: dict[str, Any], frames: list[bytes], handler: Any = handler
        ) -> Any:
            reply, out = await handler(op, src, control, frames)
            if op == "update" and control.get("i") == 0:
                out = [bytes([out[0][0] ^ 1]) + out[0][1:]]
            return reply, out

        hub.handlers[peer] = (lying, limits, screen)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_node_off_the_committee_follows_by_updates_and_falls_back_on_lies(
    tmp_path: Path,
) -> None:
    from p2pdiloco.testing.memnet import MemoryNetwork

    async def main() -> None:
        async with MemoryNetwork(
            tmp_path, nodes=5, committee_size=4, learners=4, rules={"update_codec": "int8"}
        ) as net:
            follower = net.nodes[4]  # trains nothing, so it is never elected
            tally = follower.runtime.tally
            await net.wait_for(lambda: tally.updates >= 2, 120, "two versions by update")
            assert not tally.downloads  # never a full state
            state = follower.runtime.chain.current
            assert state is not None and state.cert is not None and state.update is not None
            assert state.state_hash == state.cert.body.state_hash
            assert follower.peer_id not in state.cert.body.committee
            got = net.hub.received[follower.peer_id] / tally.updates
            assert got < state.blob().index.total_bytes / 4  # int8 g, not params + momentum
            corrupt_updates(net.hub, [n.peer_id for n in net.nodes[:4]])
            await net.wait_for(
                lambda: tally.update_fallbacks >= 1 and tally.downloads,
                120,
                "a full download after refused updates",
            )
            top = max(n.version for n in net.nodes[:4])
            await net.wait_for(lambda: follower.version >= top, 60, "the follower caught up")
            hashes = {}
            for node in net.live():
                for v, raw in node.runtime.chain.certs.items():
                    h = parse_certificate(raw, run_id=net.run_id).body.state_hash
                    assert hashes.setdefault(v, h) == h
            current = follower.runtime.chain.current
            assert current is not None and current.state_hash == hashes[current.version]

    asyncio.run(main())


def test_a_node_two_versions_behind_chains_the_two_updates(
    genesis: CertifiedState, tmp_path: Path
) -> None:
    run_id, manifest = make_run()
    chain, states, base = [], [], genesis
    for seed in (0, 1):
        inputs = round_inputs(base, seed=seed)
        _, state = next_state(base, inputs, manifest.rules, OUTER)
        state.cert = certify(run_id, manifest, base, state, inputs, state.update_hash)
        chain.append(state.cert)
        states.append(state)
        base = state
    hub = MemoryHub()
    holder = KEYS[3].peer_id
    serving(hub, tmp_path, holder, run_id, *states)  # its current and previous versions
    got = asyncio.run(
        follow_updates(hub.transport("learner"), manifest, genesis, chain, lambda c: [holder])
    )
    assert got.version == 2 and got.state_hash == chain[-1].body.state_hash
    assert hub.received["learner"] < sum(len(s.update or b"") for s in states) + 4096


def test_a_restarted_node_serves_the_saved_update_and_ignores_a_tampered_one(
    genesis: CertifiedState, tmp_path: Path
) -> None:
    run_id, _, _, state, cert = certified_round(genesis, seed=5)
    assert state.update is not None
    ChainStore(tmp_path, run_id).persist([cert], state)

    restored = ChainStore(tmp_path, run_id)
    back = restored.restore()
    assert back is not None and back.update == bytes(state.update)
    restored.install(back)
    reply, out = restored.serve("update", {"version": 1, "i": 0})
    assert reply["total_bytes"] == len(state.update) and out[0] == bytes(
        state.update[: len(out[0])]
    )

    saved = tmp_path / "updates" / f"{1:08d}.bin"
    saved.write_bytes(b"\x00" + saved.read_bytes()[1:])
    again = ChainStore(tmp_path, run_id).restore()
    assert again is not None and again.update is None  # the state stands; peers download it
    assert again.state_hash == state.state_hash


def test_a_restarted_node_resumes_the_roster_saved_beside_its_state(
    genesis: CertifiedState, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ADR 0044: the roster is not in the certificate; a checkpoint keeps it, checked against
    the certificate's roster hash, so the next election needs no walk from genesis."""
    run_id, _, _, state, cert = certified_round(genesis, seed=6)
    assert cert.roster is not None and sum(e.accepted for e in cert.roster) == 3  # 3 merged
    ChainStore(tmp_path, run_id).persist([cert], state)
    back = ChainStore(tmp_path, run_id).restore()
    assert back is not None and back.cert is not None and back.cert.roster == cert.roster

    forged = replace(
        cert, roster=tuple(e.model_copy(update={"tokens": 10**9}) for e in cert.roster)
    )
    state.cert = forged
    ChainStore(tmp_path / "forged", run_id).persist([forged], state)
    with caplog.at_level(logging.WARNING):
        assert ChainStore(tmp_path / "forged", run_id).restore() is None
    assert "the roster saved with version 1 is not its own" in caplog.text
