"""The simulator certifies what the real network certifies from the same inputs.

A tensor-mode simulation (gemma-tiny, int8 deltas sealed with the peers' real keys, committee of
one) runs a few rounds. Each certified version's input set (the sealed headers and payloads the
simulated syncer merged) is then replayed, in order, on a real ``SyncService`` holding the
simulated committee member's key, over the in-memory transport, with real signatures: every
certificate must carry the state hash the simulator certified.
"""

from __future__ import annotations

import asyncio

import pytest

from p2pdiloco.core.trust import trusted_count, trusted_peers
from p2pdiloco.net.transport import MemoryHub
from p2pdiloco.protocol.certificates import content_digest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.submissions import open_submission
from p2pdiloco.sim import SimConfig, simulate_run
from p2pdiloco.sim.backend import TensorMerge
from p2pdiloco.sim.config import identity
from p2pdiloco.sim.world import World
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.sync.service import SyncService

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("fragments", [1, 2])
def test_simulated_rounds_certify_the_real_syncers_state_hashes(fragments: int) -> None:
    """With two fragments (ADR 0032) version v merges fragment (v − 1) mod 2 only."""
    cfg = SimConfig(
        peers=4,
        committee_size=1,
        duration=900.0,
        inner_steps=20,
        step_seconds=1.0,
        speed_sigma=0.3,
        seed=5,
        batch_size=2,
        seq_len=16,
        fragments=fragments,
        rules={
            "grace": 30.0,
            "aggregation": "trimmed_mean",
            "min_quorum_fraction": 1.0,
            "linger": 0.0,
        },
    )
    merge = TensorMerge(seed=cfg.seed)
    result, world = simulate_run(cfg, merge, baseline=False)
    assert result.versions >= 8, result
    # At least 8 versions, and on to the first one whose election seated another member: the
    # replay then covers more than one elected syncer. Submissions are signed at simulated
    # times, so a seed gives the same beacons and elections every run (test below).
    moved = next(
        (i for i, c in enumerate(world.certs) if c.committee != world.certs[0].committee),
        len(world.certs) - 1,
    )
    certs = world.certs[: max(8, moved + 1)]
    assert all(len(c.merged) >= 2 for c in certs)  # real rounds: several learners merged

    async def replay() -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        hub = MemoryHub()
        base = merge.genesis
        for cert in certs:
            # The member the simulation elected: the real service must find itself elected too.
            syncer = identity(cfg.seed, world.by_id[cert.committee[0]])
            done: asyncio.Future[CertifiedState] = asyncio.get_running_loop().create_future()
            sender = {
                d: open_submission(merge.sealed[d], run_id=world.run_id).header.peer_id
                for d in cert.merged
            }
            service = _service(syncer, world, base, hub, list(sender.values()), done)
            await service.install(base)
            # The round closes once every trusted sender is in: probationary ones go first.
            trusted = trusted_peers(world.manifest, base.cert)
            for d in sorted(cert.merged, key=lambda d: trusted_count(trusted, [sender[d]])):
                frames = [merge.sealed[d], merge.payloads[d]]
                reply, _ = await service.handle("submit", "x", {}, frames)
                assert reply["status"] == "accepted", reply
            base = await asyncio.wait_for(done, 60)
            await service.close()
            assert base.cert is not None
            out.append((base.state_hash, content_digest(base.cert.body)))
        return out

    # Same states, and the same certificate content (receipts, roster, committee: the beacon of
    # the next election), so the simulated chain is the real one.
    assert asyncio.run(replay()) == [(c.state_hash, c.content) for c in certs]
    assert len({c.committee for c in certs}) > 1  # elections moved the seat among the peers


def _service(
    syncer: Identity,
    world: World,
    base: CertifiedState,
    hub: MemoryHub,
    learners: list[str],
    done: asyncio.Future[CertifiedState],
) -> SyncService:
    def certified(raw: bytes, state: CertifiedState | None) -> None:
        assert state is not None
        done.set_result(state)

    return SyncService(
        syncer,
        world.run_id,
        world.manifest,
        {n: tuple(t.shape) for n, t in base.params.items()},
        hub.transport(syncer.peer_id),
        live_learners=lambda: learners,
        on_certified=certified,
    )


def test_a_tensor_mode_seed_certifies_the_same_chain_twice() -> None:
    """Signed headers carry the simulated time, not the wall clock: the same seed gives the
    same submission digests, state hashes, beacons and committees."""
    cfg = SimConfig(
        peers=3,
        committee_size=1,
        duration=100.0,
        inner_steps=20,
        step_seconds=1.0,
        speed_sigma=0.3,
        seed=5,
        batch_size=2,
        seq_len=16,
        rules={"grace": 30.0, "aggregation": "trimmed_mean", "linger": 0.0},
    )

    def chain() -> list[tuple[int, str, tuple[str, ...], tuple[str, ...]]]:
        _, world = simulate_run(cfg, TensorMerge(seed=cfg.seed), baseline=False)
        return [(c.version, c.state_hash, c.committee, c.merged) for c in world.certs]

    first = chain()
    assert len(first) >= 3
    assert chain() == first
