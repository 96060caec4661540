"""The network syncer and ``simulate`` certify bit-identical states from the same inputs.

A real ``SyncService`` (committee of one, real signatures, the in-memory transport) receives
three learners' signed, int8-compressed deltas of gemma-tiny and certifies version 1; the
simulator's merge step (``harness.simulate.merge_fragment``) gets the same decoded deltas and
token counts. Parameters and outer momentum must match bit for bit.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2pdiloco.compress import get_codec
from p2pdiloco.compress.wire import pack_deltas
from p2pdiloco.harness.simulate import merge_fragment
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.net.transport import MemoryHub
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.submissions import (
    FragmentRef,
    SubmissionHeader,
    open_submission,
    payload_digest,
    seal_submission,
)
from p2pdiloco.sync.certified import CertifiedState, genesis_state
from p2pdiloco.sync.service import SyncService
from p2pdiloco.train.outer import OuterConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("rule", ["mean", "trimmed_mean", "median"])
def test_network_syncer_and_simulate_merge_bit_identically(rule: str) -> None:
    syncer = Identity.generate()
    learners = [Identity.generate() for _ in range(3)]
    run_id, manifest, _ = create_manifest(
        syncer,
        name="same",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=4,
        committee_size=1,
        compression="int8",
        genesis_committee=[syncer.peer_id],
        rules={"aggregation": rule, "grace": 30.0, "min_quorum_fraction": 1.0},
    )
    base = genesis_state(manifest)
    codec = get_codec("int8")
    gen = torch.Generator().manual_seed(7)
    tokens = [256, 512, 768]
    sent = []
    for ident, tok in zip(learners, tokens, strict=True):
        delta = {n: 1e-3 * torch.randn(t.shape, generator=gen) for n, t in base.params.items()}
        payload = pack_deltas({n: codec.encode(delta[n]) for n in sorted(delta)})
        header = SubmissionHeader(
            peer_id=ident.peer_id,
            base_version=0,
            steps=4,
            tokens=tok,
            loss=3.0,
            codec="int8",
            fragments=[FragmentRef(index=0, digest=payload_digest(payload), nbytes=len(payload))],
        )
        sent.append((seal_submission(ident, run_id, header), payload, tok))

    async def certify() -> CertifiedState:
        done: asyncio.Future[CertifiedState] = asyncio.get_running_loop().create_future()
        service = SyncService(
            syncer,
            run_id,
            manifest,
            {n: tuple(t.shape) for n, t in base.params.items()},
            MemoryHub().transport(syncer.peer_id),
            live_learners=lambda: ["l0", "l1", "l2"],
            on_certified=lambda raw, st: done.set_result(st),  # type: ignore[arg-type]
        )
        await service.install(base)
        for header, payload, _ in sent:
            reply, _ = await service.handle("submit", "x", {}, [header, payload])
            assert reply["status"] == "accepted", reply
        state = await asyncio.wait_for(done, 60)
        await service.close()
        return state

    certified = asyncio.run(certify())
    assert certified is not None and certified.cert is not None
    assert certified.state_hash == certified.cert.body.state_hash

    # The simulator's step on the same decoded deltas, in the order the syncer merges them
    # (sorted submission ids).
    order = sorted(range(3), key=lambda i: open_submission(sent[i][0], run_id=run_id).digest)
    decoded = [{n: codec.decode(e) for n, e in _unpack(sent[i][1], base).items()} for i in order]
    theta = {n: t.clone() for n, t in base.params.items()}
    momentum = {n: m.clone() for n, m in base.momentum.items()}
    o = manifest.outer
    merge_fragment(
        theta,
        momentum,
        decoded,
        [sent[i][2] for i in order],
        sorted(theta),
        rules=manifest.rules,
        outer=OuterConfig(lr=o.lr, momentum=o.momentum, nesterov=o.nesterov),
    )
    for n in theta:
        assert torch.equal(theta[n], certified.params[n]), n
        assert torch.equal(momentum[n], certified.momentum[n]), n


def _unpack(payload: bytes, base: CertifiedState) -> dict:
    from p2pdiloco.compress.wire import unpack_deltas

    shapes = {n: tuple(t.shape) for n, t in sorted(base.params.items())}
    return unpack_deltas(payload, expected=shapes, codec="int8", max_bytes=1 << 30)
