"""Run one simulation and sum it up.

Goodput = tokens that end up in certified versions (the steps trained into merged deltas,
carried steps included; ``credited_share`` is what the certificates credit, claims clipped to
H) ÷ tokens the hardware could have trained in the same wall time (each peer's tokens per second × the time it was up and in the run). A peer's
own down time is not counted against either method: a crashed machine trains nothing under any
algorithm. Certified wrong states (more than a third of a committee faulty) count for nothing.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from p2pdiloco.sim.backend import Merge, MetadataMerge
from p2pdiloco.sim.config import Fault, SimConfig, fault_schedule, profiles
from p2pdiloco.sim.dp import DataParallelResult, data_parallel
from p2pdiloco.sim.world import World


@dataclass(frozen=True)
class SimResult:
    peers: int
    duration: float
    versions: int
    goodput: float  # certified tokens ÷ capacity
    trained_share: float  # tokens trained (merged or not) ÷ capacity
    credited_tokens: int  # what the certificates credit (claims clipped to H)
    all_time_tokens: float  # every peer's speed × the whole duration, down time included
    credited_share: float  # tokens the certificates credit ÷ capacity
    capacity_tokens: float
    certified_tokens: int
    latency_p50: float  # seconds from a round's opening to its certificate
    latency_p95: float
    latency_p99: float
    view_changes: int
    failed_merges: int
    conflicts: int  # versions certified twice with different states (must be 0)
    wrong_certificates: int  # versions certifying a state no honest syncer computed (must be 0)
    faults: int
    learner_bytes_per_delta: float  # up (every copy) + its share of the downloads
    certificate_bytes_max: int  # the largest certificate (receipts grow with the inputs merged)
    syncer_bytes_per_round: float  # received by one member in one round
    relayed_bytes_per_round: float  # learners' deltas one member passed on in one round
    events: int
    wall_seconds: float
    data_parallel: DataParallelResult | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def simulate_run(
    cfg: SimConfig,
    merge: Merge | None = None,
    *,
    baseline: bool = True,
    checkpoint_seconds: float = 600.0,
    faults: list[Fault] | None = None,
    step_seconds: dict[int, float] | None = None,
) -> tuple[SimResult, World]:
    """Simulate ``cfg.duration`` seconds; with ``baseline``, data-parallel on the same faults
    (checkpointing every ``checkpoint_seconds`` of training). ``faults`` replaces the drawn
    schedule (a measured one, e.g. ``bench/chaos.py``'s) and ``step_seconds`` the drawn speed
    of the peers it names (profile index → seconds per inner step)."""
    started = time.perf_counter()
    rng = random.Random(cfg.seed)
    drawn, count = fault_schedule(cfg, rng)
    if faults is None:
        faults = drawn
    else:
        faults = sorted(faults, key=lambda f: f.time)
        count = max([cfg.peers - 1, *(f.peer for f in faults)]) + 1
    profs = [
        replace(p, step_seconds=step_seconds[p.index])
        if step_seconds and p.index in step_seconds
        else p
        for p in profiles(cfg, count, rng)
    ]
    world = World(cfg, merge or MetadataMerge(), profs)
    world.start(faults)
    world.clock.run(cfg.duration)
    world.finish()
    capacity = sum(
        p.up_seconds * cfg.tokens_per_step / p.profile.step_seconds for p in world.peers.values()
    )
    good = [c for c in world.certs if not c.wrong]
    certified = sum(c.tokens for c in good)
    lat = [c.certified_at - c.opened_at for c in world.certs]
    deltas = max(1, world.deltas_sent)
    dp = (
        data_parallel(cfg, profs, faults, checkpoint_seconds=checkpoint_seconds)
        if baseline
        else None
    )
    result = SimResult(
        peers=cfg.peers,
        duration=cfg.duration,
        versions=world.version,
        goodput=certified / capacity if capacity else 0.0,
        trained_share=world.trained_tokens / capacity if capacity else 0.0,
        credited_share=sum(c.credited for c in good) / capacity if capacity else 0.0,
        credited_tokens=sum(c.credited for c in good),
        all_time_tokens=sum(
            cfg.duration * cfg.tokens_per_step / profs[i].step_seconds for i in range(cfg.peers)
        ),
        capacity_tokens=capacity,
        certified_tokens=certified,
        latency_p50=_percentile(lat, 50),
        latency_p95=_percentile(lat, 95),
        latency_p99=_percentile(lat, 99),
        view_changes=world.view_changes,
        failed_merges=world.failed_merges,
        conflicts=world.conflicts,
        wrong_certificates=len(world.certs) - len(good),
        faults=sum(1 for f in faults if f.kind in ("down", "leave")),
        learner_bytes_per_delta=(world.learner_up + world.learner_down) / deltas,
        certificate_bytes_max=max((c.nbytes for c in world.certs), default=0),
        syncer_bytes_per_round=world.syncer_in / max(1, world.member_rounds),
        relayed_bytes_per_round=world.relayed / max(1, world.member_rounds),
        events=world.clock.events,
        wall_seconds=time.perf_counter() - started,
        data_parallel=dp,
    )
    return result, world
