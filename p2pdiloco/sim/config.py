"""What a simulated run looks like: peers, links, failures, churn, faulty syncers.

Everything random is drawn from one seeded generator, up front where it can be (peer profiles,
the fault schedule), so a run is reproducible and the data-parallel baseline (``sim.dp``) sees
exactly the same failures as the DiLoCo run.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from p2pdiloco.protocol.identity import Identity


@dataclass(frozen=True)
class SimConfig:
    peers: int = 64  # peers present at the start; each is one island (a learner)
    committee_size: int = 8
    duration: float = 3600.0  # simulated seconds
    inner_steps: int = 100  # H
    # Streaming DiLoCo fragments P (ADR 0032): a learner sends a fragment every H/P steps, so a
    # delta, a certified update and a merge input hold 1/P of the model: the byte sizes and
    # the merge time below are the whole model's, and are divided by P where a fragment moves.
    fragments: int = 1
    step_seconds: float = 1.0  # median seconds per inner step
    speed_sigma: float = 0.3  # lognormal sigma of the per-peer step time
    # Seconds of training per delta (the manifest's time budget); None: H × step_seconds, so a
    # slow island sends fewer steps instead of holding the round; 0: no budget (H steps each).
    time_budget: float | None = None
    batch_size: int = 8
    seq_len: int = 512
    codec: str = "int8"  # the manifest's delta codec (tensor mode encodes with it)
    payload_bytes: int = 4_000_000  # one compressed delta
    update_bytes: int = 4_000_000  # what a learner downloads per certified version
    state_bytes: int = 200_000_000  # full state, downloaded after a restart or by a joiner
    up_mbps: float = 100.0  # median upload
    down_mbps: float = 500.0  # median download
    bw_sigma: float = 0.5  # lognormal sigma of both
    latency_ms: tuple[float, float] = (20.0, 150.0)  # one way, uniform per peer
    merge_seconds_per_input: float = 0.02  # a syncer's merge time per delta
    # From a certificate reaching a peer to its update applied and the state checked: a learner
    # trains on meanwhile, a member of the next committee that did not compute the state opens
    # its round after it. 0: at once. ``bench/chaos_predict.py`` uses a measured one.
    apply_seconds: float = 0.0
    mtbf_hours: float | None = None  # per peer mean time between failures; None: none
    repair_seconds: float = 600.0  # mean down time after a failure (exponential)
    restart_seconds: float = 30.0  # process start and state load after a repair
    churn_per_hour: float = 0.0  # share of the peers that leave per hour (as many fresh join)
    faulty_syncers: float = 0.0  # share of peers that, on a committee, sign a wrong state
    rules: dict[str, Any] = field(default_factory=dict)  # manifest rule overrides
    max_inputs: int | None = None  # a syncer's local bound; None: held_cap of one delta
    seed: int = 0

    def __post_init__(self) -> None:
        if self.peers < 1 or self.committee_size < 1 or self.duration <= 0:
            raise ValueError("peers, committee_size and duration must be positive")
        if not 0 <= self.faulty_syncers < 1 or self.churn_per_hour < 0:
            raise ValueError("faulty_syncers must be in [0, 1), churn_per_hour ≥ 0")
        if self.fragments < 1 or self.inner_steps % self.fragments:
            raise ValueError("inner_steps must be a multiple of fragments (at least 1)")

    @property
    def budget(self) -> float | None:
        if self.time_budget == 0:
            return None
        return self.time_budget or self.stretch_steps * self.step_seconds

    @property
    def stretch_steps(self) -> int:
        """Inner steps per delta: H/P."""
        return self.inner_steps // self.fragments

    @cached_property  # read at every transfer; the config is frozen
    def delta_bytes(self) -> int:
        """One delta on the wire: one fragment's share of ``payload_bytes``."""
        return max(1, self.payload_bytes // self.fragments)

    @cached_property
    def fragment_update_bytes(self) -> int:
        """One certified update: one fragment's share of ``update_bytes``."""
        return max(1, self.update_bytes // self.fragments)

    @cached_property
    def merge_seconds(self) -> float:
        """A syncer's merge time per input of one fragment."""
        return self.merge_seconds_per_input / self.fragments

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def identity(seed: int, index: int) -> Identity:
    """Peer ``index``'s key, derived from (seed, index): a tensor-mode run seals real
    submissions with it, and a test can rebuild the same key to replay them on a real syncer."""
    return Identity.from_seed(hashlib.sha256(f"sim/{seed}/{index}".encode()).digest())


@dataclass(frozen=True)
class Profile:
    index: int
    peer_id: str
    step_seconds: float
    up_bps: float  # bytes per second
    down_bps: float
    latency: float  # seconds, one way
    faulty: bool  # signs a wrong state when on a committee (colluding with the other faulty)


def profiles(cfg: SimConfig, count: int, rng: random.Random) -> list[Profile]:
    """``count`` peer profiles (the initial peers and every joiner), drawn in index order."""
    out = []
    for i in range(count):
        out.append(
            Profile(
                index=i,
                peer_id=identity(cfg.seed, i).peer_id,
                step_seconds=cfg.step_seconds * math.exp(rng.gauss(0.0, cfg.speed_sigma)),
                up_bps=cfg.up_mbps * 125_000 * math.exp(rng.gauss(0.0, cfg.bw_sigma)),
                down_bps=cfg.down_mbps * 125_000 * math.exp(rng.gauss(0.0, cfg.bw_sigma)),
                latency=rng.uniform(*cfg.latency_ms) / 1000,
                faulty=rng.random() < cfg.faulty_syncers,
            )
        )
    return out


@dataclass(frozen=True)
class Fault:
    time: float
    peer: int  # profile index
    kind: str  # "down", "up" (repaired, restarts), "leave" (for good), "join" (fresh peer)


def fault_schedule(cfg: SimConfig, rng: random.Random) -> tuple[list[Fault], int]:
    """The failures and churn of the run, sorted by time, and how many profiles they use.

    Each present peer fails after an exponential time of mean ``mtbf_hours`` and comes back
    after an exponential repair of mean ``repair_seconds``; departures come as a Poisson
    process of rate ``churn_per_hour × peers`` per hour, each leaving peer replaced at once by a
    fresh one (new identity, new profile index)."""
    faults: list[Fault] = []
    present = list(range(cfg.peers))
    next_index = cfg.peers
    if cfg.churn_per_hour > 0:
        t, rate = 0.0, cfg.churn_per_hour * cfg.peers / 3600
        while True:
            t += rng.expovariate(rate)
            if t >= cfg.duration:
                break
            gone = present.pop(rng.randrange(len(present)))
            faults += [Fault(t, gone, "leave"), Fault(t, next_index, "join")]
            present.append(next_index)
            next_index += 1
    if cfg.mtbf_hours is not None:
        lives = {f.peer: f.time for f in faults if f.kind == "leave"}
        born = {f.peer: f.time for f in faults if f.kind == "join"}
        for p in range(next_index):
            t, end = born.get(p, 0.0), min(lives.get(p, cfg.duration), cfg.duration)
            while True:
                t += rng.expovariate(1 / (cfg.mtbf_hours * 3600))
                if t >= end:
                    break
                back = t + rng.expovariate(1 / cfg.repair_seconds)
                faults.append(Fault(t, p, "down"))
                if back < end:
                    faults.append(Fault(back, p, "up"))
                t = back
    order = {"leave": 0, "down": 1, "up": 2, "join": 3}
    faults.sort(key=lambda f: (f.time, order[f.kind], f.peer))
    return faults, next_index


class PeerState(Protocol):
    """A simulated peer as the learner and the members see it (``sim.world.Peer`` is it)."""

    @property
    def profile(self) -> Profile: ...
    @property
    def up(self) -> bool: ...
    @property
    def epoch(self) -> int: ...  # bumped by every crash
