"""A learner's submission sent twice (the reply to the first was lost) is held once and
answered as the first time: never refused as a replay of itself, never merged twice."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2pdiloco.compress import get_codec
from p2pdiloco.compress.wire import pack_deltas
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.net.transport import MemoryHub
from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.submissions import (
    FragmentRef,
    SubmissionHeader,
    payload_digest,
    seal_submission,
)
from p2pdiloco.sync.certified import genesis_state
from p2pdiloco.sync.service import SyncService

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_resent_submission_is_accepted_again_and_merged_once() -> None:
    syncer = Identity.generate()
    learners = [Identity.generate() for _ in range(3)]
    run_id, manifest, _ = create_manifest(
        syncer,
        name="resend",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=4,
        committee_size=1,
        compression="int8",
        genesis_committee=[syncer.peer_id],
        rules={"grace": 30.0, "min_quorum_fraction": 1.0},
    )
    base = genesis_state(manifest)
    codec = get_codec("int8")
    gen = torch.Generator().manual_seed(3)
    sent = []
    for ident in learners:
        delta = {n: 1e-3 * torch.randn(t.shape, generator=gen) for n, t in base.params.items()}
        payload = pack_deltas({n: codec.encode(delta[n]) for n in sorted(delta)})
        header = SubmissionHeader(
            peer_id=ident.peer_id,
            base_version=0,
            steps=4,
            tokens=256,
            loss=3.0,
            codec="int8",
            fragments=[FragmentRef(index=0, digest=payload_digest(payload), nbytes=len(payload))],
        )
        sent.append((seal_submission(ident, run_id, header), payload))

    async def main() -> tuple[list[dict], bytes, list[dict]]:
        done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        service = SyncService(
            syncer,
            run_id,
            manifest,
            {n: tuple(t.shape) for n, t in base.params.items()},
            MemoryHub().transport(syncer.peer_id),
            live_learners=lambda: ["l0", "l1", "l2"],
            on_certified=lambda raw, st: done.set_result(raw),
        )
        await service.install(base)
        replies = []
        first, payload = sent[0]
        for raw, body in [sent[0], (first, payload), sent[1], (first, payload), sent[2]]:
            reply, _ = await service.handle("submit", "x", {}, [raw, body])
            replies.append(reply)
        cert = await asyncio.wait_for(done, 60)
        rejections = list(service.rejections)
        await service.close()
        return replies, cert, rejections

    replies, raw, rejections = asyncio.run(main())
    assert [r["status"] for r in replies] == ["accepted"] * 5, replies
    body = parse_certificate(raw, run_id=run_id).body
    assert sorted(a.peer_id for a in body.accepted) == sorted(i.peer_id for i in learners)
    assert rejections == []
