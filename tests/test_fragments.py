"""Streaming DiLoCo fragments on the network (ADR 0032): the round on version v syncs fragment
v mod P, its committee merges and steps only that fragment, followers apply the fragment's
certified update to exactly the certified state, a syncer refuses another fragment's delta, and
a learner's delta holds one fragment while the rest of its progress stays for later rounds.

Real gemma-tiny tensors and committee signatures in process; the last test runs four whole
nodes over the in-memory transport (``testing/memnet.py``)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
import torch

from p2pdiloco.compress import get_codec
from p2pdiloco.compress.wire import pack_deltas
from p2pdiloco.core.bounded import ReplayGuard
from p2pdiloco.core.roster import committee_for, with_roster
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.certificates import Certificate, assemble, parse_certificate, sign_body
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.submissions import (
    FragmentRef,
    SubmissionHeader,
    open_submission,
    payload_digest,
    seal_submission,
)
from p2pdiloco.sync.aggregator import MergeInput
from p2pdiloco.sync.certified import CertifiedState, apply_update, genesis_state, next_state
from p2pdiloco.sync.committee_msgs import body_of
from p2pdiloco.sync.fragments import fragment_plan, round_fragment, round_names
from p2pdiloco.sync.intake import Intake
from p2pdiloco.sync.rules import UnsupportedManifest, check_supported
from p2pdiloco.sync.update import UpdateError
from p2pdiloco.testing.memnet import MemoryNetwork
from p2pdiloco.train.configs import OuterConfig
from p2pdiloco.train.learner import Outgoing, rebase_anchor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEYS = [Identity.from_seed(hashlib.sha256(b"fragment%d" % i).digest()) for i in range(4)]
BY_ID = {k.peer_id: k for k in KEYS}
P = 4


def make_run(fragments: int = P, **rules: object) -> tuple[str, RunManifest]:
    run_id, manifest, _ = create_manifest(
        KEYS[0],
        name="fragments",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=8,
        committee_size=4,
        compression="int8",
        genesis_committee=[k.peer_id for k in KEYS],
        outer={"fragments": fragments},
        rules={"aggregation": "trimmed_mean", "update_codec": "int8", **rules},
    )
    return run_id, manifest


@pytest.fixture(scope="module")
def run() -> tuple[str, RunManifest, CertifiedState]:
    run_id, manifest = make_run()
    return run_id, manifest, genesis_state(manifest)


def shapes_of(state: CertifiedState) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in state.params.items()}


def outer_of(manifest: RunManifest) -> OuterConfig:
    return OuterConfig(**manifest.outer.model_dump())


def inputs_for(base: CertifiedState, names: list[str], seed: int = 0) -> list[MergeInput]:
    g = torch.Generator().manual_seed(seed)
    return [
        MergeInput(
            f"{i:02x}" * 32,
            KEYS[i].peer_id,
            {n: 1e-3 * torch.randn(base.params[n].shape, generator=g) for n in names},
            1.0,
        )
        for i in range(3)
    ]


def certify(
    run_id: str,
    manifest: RunManifest,
    base: CertifiedState,
    state: CertifiedState,
    inputs: list[MergeInput],
) -> Certificate:
    committee = committee_for(run_id, manifest, base.cert)
    senders = {i.digest: (i.peer_id, 2, 2 * 64) for i in inputs}
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
        state.update_hash,
    )
    sigs = {p: sign_body(BY_ID[p], body) for p in body.committee}
    return with_roster(manifest, base.cert, parse_certificate(assemble(body, sigs), run_id=run_id))


def test_the_plan_is_balanced_disjoint_and_the_same_for_every_order(
    run: tuple[str, RunManifest, CertifiedState],
) -> None:
    _, _, genesis = run
    shapes = shapes_of(genesis)
    plan = fragment_plan(shapes, P)
    assert len(plan) == P and sorted(n for f in plan for n in f) == sorted(shapes)
    sizes = [sum(genesis.params[n].numel() for n in f) for f in plan]
    largest = max(t.numel() for t in genesis.params.values())
    assert max(sizes) - min(sizes) <= largest  # greedy LPT: within one tensor of balanced
    assert fragment_plan(dict(reversed(list(shapes.items()))), P) == plan
    assert [round_fragment(v, P) for v in range(6)] == [0, 1, 2, 3, 0, 1]
    assert round_names(shapes, 1, 5) == sorted(shapes)  # P = 1: the whole model every round
    with pytest.raises(ValueError):
        fragment_plan(shapes, len(shapes) + 1)


def test_each_round_steps_only_its_fragment_and_followers_reach_the_certified_hash(
    run: tuple[str, RunManifest, CertifiedState],
) -> None:
    run_id, manifest, state = run
    outer = outer_of(manifest)
    plan = fragment_plan(shapes_of(state), P)
    for v in range(P + 1):  # every fragment once, then fragment 0 again
        names = plan[v % P]
        inputs = inputs_for(state, names, seed=v)
        result, new = next_state(state, inputs, manifest.rules, outer)
        assert len(result.accepted) == 3 and new.update is not None
        for n in state.params:
            changed = not torch.equal(new.params[n], state.params[n])
            assert changed == (n in names), (v, n)
            if n not in names:  # shared, not copied
                assert new.params[n] is state.params[n] and new.momentum[n] is state.momentum[n]
        cert = certify(run_id, manifest, state, new, inputs)
        got = apply_update(state, cert, new.update, manifest.rules, outer)
        assert got.state_hash == cert.body.state_hash == new.state_hash
        new.cert = cert
        state = new
    assert state.version == P + 1


def test_a_fragment_update_applied_to_another_round_is_refused(
    run: tuple[str, RunManifest, CertifiedState],
) -> None:
    run_id, manifest, genesis = run
    outer = outer_of(manifest)
    names0 = fragment_plan(shapes_of(genesis), P)[0]
    inputs = inputs_for(genesis, names0)
    _, v1 = next_state(genesis, inputs, manifest.rules, outer)
    v1.cert = certify(run_id, manifest, genesis, v1, inputs)
    names1 = fragment_plan(shapes_of(genesis), P)[1]
    inputs1 = inputs_for(v1, names1, seed=1)
    _, v2 = next_state(v1, inputs1, manifest.rules, outer)
    cert2 = certify(run_id, manifest, v1, v2, inputs1)
    assert v1.update is not None
    # Fragment 0's update served for version 2 (fragment 1): its hash is not the certified one.
    with pytest.raises(UpdateError) as e:
        apply_update(v1, cert2, v1.update, manifest.rules, outer)
    assert e.value.code is Reason.DIGEST_MISMATCH
    # A merge whose deltas missed a tensor of the fragment is refused by every honest syncer.
    short = [MergeInput(i.digest, i.peer_id, dict(list(i.delta.items())[1:]), 1.0) for i in inputs1]
    with pytest.raises(Exception, match="tensor|shape|missing"):
        next_state(v1, short, manifest.rules, outer)


def seal(run_id: str, key: Identity, base_version: int, payload: bytes, index: int) -> bytes:
    header = SubmissionHeader(
        peer_id=key.peer_id,
        base_version=base_version,
        steps=2,
        tokens=128,
        loss=3.0,
        codec="int8",
        fragments=[FragmentRef(index=index, digest=payload_digest(payload), nbytes=len(payload))],
    )
    return seal_submission(key, run_id, header)


def test_a_syncer_takes_only_the_rounds_fragment(
    run: tuple[str, RunManifest, CertifiedState],
) -> None:
    run_id, manifest, genesis = run
    shapes = shapes_of(genesis)
    plan = fragment_plan(shapes, P)
    intake = Intake(manifest, shapes, run_id)
    codec = get_codec("int8")

    def payload(names: list[str]) -> bytes:
        return pack_deltas({n: codec.encode(torch.zeros(shapes[n])) for n in sorted(names)})

    async def check(raw: bytes, body: bytes, current: int) -> tuple[Reason, str] | None:
        return await intake.check(
            open_submission(raw, run_id=run_id), body, current, ReplayGuard.for_staleness(0)
        )

    good = payload(plan[1])
    assert asyncio.run(check(seal(run_id, KEYS[1], 1, good, 1), good, 1)) is None
    # The right tensors under another fragment's index, or the wrong tensors: refused, one line.
    code, text = asyncio.run(check(seal(run_id, KEYS[1], 1, good, 0), good, 1))  # type: ignore[misc]
    assert code is Reason.WRONG_FRAGMENT and "fragment 1 of 4" in text and "\n" not in text
    other = payload(plan[2])
    code, text = asyncio.run(check(seal(run_id, KEYS[1], 1, other, 1), other, 1))  # type: ignore[misc]
    assert code is Reason.MALFORMED
    whole = payload(sorted(shapes))  # the whole model is far over one fragment's size limit
    assert len(whole) > intake.fragment_max[1]
    code, _ = asyncio.run(check(seal(run_id, KEYS[1], 1, whole, 1), whole, 1))  # type: ignore[misc]
    assert code is Reason.MALFORMED
    assert intake.max_payload < sum(codec.wire_bytes(t.numel()) for t in genesis.params.values())


def test_fragments_need_h_a_multiple_of_p_and_staleness_zero() -> None:
    check_supported(make_run()[1])
    with pytest.raises(UnsupportedManifest, match="staleness"):
        check_supported(make_run(staleness=1)[1])
    _, bad = make_run(3)  # H = 8
    with pytest.raises(UnsupportedManifest, match="multiple"):
        check_supported(bad)


def test_a_rebase_keeps_the_progress_of_the_fragments_not_sent() -> None:
    old = {"a": torch.zeros(3), "b": torch.zeros(3)}
    sent = Outgoing(0, b"", 1, 1, 0.0, sent_params={"a": torch.full((3,), 2.0)})
    anchor = rebase_anchor(old, sent)
    assert torch.equal(anchor["a"], sent.sent_params["a"]) and anchor["b"] is old["b"]
    assert rebase_anchor(old, None) is old


@pytest.mark.slow
def test_four_nodes_certify_every_fragment_with_its_own_committee(tmp_path: Path) -> None:
    async def main() -> None:
        async with MemoryNetwork(
            tmp_path, nodes=4, committee_size=3, inner_steps=8, fragments=P
        ) as net:
            await net.wait_for(lambda: net.min_version() >= P + 1, 150, "a round per fragment")
            node = net.nodes[0]
            certs = {
                v: parse_certificate(raw, run_id=net.run_id).body
                for v, raw in node.runtime.chain.certs.items()
            }
            assert set(range(1, P + 2)) <= set(certs)
            for v in range(1, P + 2):
                assert certs[v].accepted, f"version {v} (fragment {(v - 1) % P}) merged nothing"
            # Each fragment's round has the committee its own beacon elected.
            assert len({tuple(certs[v].committee) for v in range(1, P + 2)}) >= 2
            for n in net.nodes:
                assert n.trainer is not None and n.trainer.view.error is None
                assert n.trainer.machine.inner_steps == 2  # a fragment every H/P steps
            states = {n.runtime.chain.current.state_hash for n in net.nodes}  # type: ignore[union-attr]
            assert len(states) <= 2  # all on the newest version, or one behind

    asyncio.run(main())
