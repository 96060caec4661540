"""Synchronous data-parallel on the same peers and the same fault schedule, for comparison.

Generous to data-parallel where the model has to choose: the batch is split in proportion to
each worker's speed (no waiting for the slowest), the all-reduce costs nothing, and a checkpoint
costs nothing. What it cannot escape is synchrony: when any worker fails or leaves, every
worker stalls until the failed one is repaired (or replaced by a spare after
``replace_seconds``), the job restarts (``restart_seconds``) and resumes from its last
checkpoint (taken every ``checkpoint_seconds`` of training): the work since then is lost.
Peers that join wait for the next restart. Goodput has the same denominator as DiLoCo's
(``sim.run``): tokens the peers could have trained while up, plus the spares' time in use.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pdiloco.sim.config import Fault, Profile, SimConfig


@dataclass(frozen=True)
class DataParallelResult:
    goodput: float
    committed_tokens: float
    capacity_tokens: float
    stalls: int
    stalled_seconds: float
    lost_tokens: float  # trained after a checkpoint, then lost to a failure
    checkpoint_seconds: float
    replace_seconds: float | None
    restart_seconds: float


def up_seconds(cfg: SimConfig, count: int, faults: list[Fault]) -> list[float]:
    """Seconds each profile was up and in the run (the capacity, as ``sim.world`` counts it)."""
    since: dict[int, float] = {i: 0.0 for i in range(cfg.peers)}
    total = [0.0] * count
    for f in faults:
        if f.kind in ("down", "leave") and f.peer in since:
            total[f.peer] += f.time - since.pop(f.peer)
        elif f.kind in ("up", "join"):
            since.setdefault(f.peer, f.time)
    for p, t in since.items():
        total[p] += cfg.duration - t
    return total


def data_parallel(
    cfg: SimConfig,
    profs: list[Profile],
    faults: list[Fault],
    *,
    checkpoint_seconds: float = 600.0,
    replace_seconds: float | None = None,
) -> DataParallelResult:
    rate = {p.index: cfg.tokens_per_step / p.step_seconds for p in profs}
    workers = set(range(cfg.peers))  # in the job
    waiting: set[int] = set()  # joined or repaired since the last restart: in at the next one
    down: dict[int, float] = {}  # failed workers → when they stop blocking (inf: their repair)
    committed = lost = stalled = 0.0
    stalls = 0
    t = 0.0  # time the simulation has reached
    running_since: float | None = 0.0  # training resumed at (None: stalled)
    last_ckpt = 0.0
    restart_at: float | None = None
    spare_since: dict[int, float] = {}  # worker → since when a spare stands in for it
    spare_seconds = 0.0  # weighted by the speed of the worker each spare replaced

    def speed() -> float:
        return sum(rate[w] for w in workers)

    def advance(to: float) -> None:
        nonlocal t, committed, last_ckpt, running_since, restart_at, stalled
        while t < to:
            if running_since is not None:
                nxt = min(to, last_ckpt + checkpoint_seconds)
                if nxt >= last_ckpt + checkpoint_seconds:
                    committed += speed() * (nxt - last_ckpt)
                    last_ckpt = nxt
                t = nxt
                continue
            if down:  # wait until every failed worker is back, replaced or dropped
                until = max(down.values())
                if until > to:
                    stalled += to - t
                    t = to
                    continue
                stalled += until - t
                t = until
                for w, at in down.items():  # spares (more hardware) work until the repairs
                    if w >= 0 and at < float("inf"):
                        spare_since[w] = at
                down.clear()
            if restart_at is None:
                restart_at = t + cfg.restart_seconds
            if restart_at > to:
                stalled += to - t
                t = to
                continue
            stalled += restart_at - t
            t = last_ckpt = restart_at
            running_since, restart_at = t, None
            workers.update(waiting)
            waiting.clear()

    for f in faults:
        if f.time >= cfg.duration:
            break
        advance(f.time)
        if f.kind in ("down", "leave") and (f.peer in workers or f.peer in waiting):
            waiting.discard(f.peer)
            if f.peer not in workers:
                continue
            if running_since is not None:
                lost += speed() * (t - last_ckpt)
                stalls += 1
            running_since, restart_at = None, None
            if f.kind == "leave":
                workers.discard(f.peer)
                down[-f.peer - 1] = t + (replace_seconds or 0.0)  # re-formed without it
            else:
                down[f.peer] = t + replace_seconds if replace_seconds is not None else float("inf")
        elif f.kind == "up" and f.peer in down:
            del down[f.peer]
        elif f.kind == "up" and f.peer in spare_since:  # back: its spare leaves
            spare_seconds += rate[f.peer] * (t - spare_since.pop(f.peer))
        elif f.kind in ("up", "join") and f.peer not in workers:
            waiting.add(f.peer)
    advance(cfg.duration)
    if running_since is not None:
        committed += speed() * (t - last_ckpt)  # a last checkpoint at the end
    spare_seconds += sum(rate[w] * (cfg.duration - since) for w, since in spare_since.items())
    capacity = sum(s * rate[i] for i, s in enumerate(up_seconds(cfg, len(profs), faults)))
    capacity += spare_seconds  # the spares are hardware too
    return DataParallelResult(
        goodput=committed / capacity if capacity else 0.0,
        committed_tokens=committed,
        capacity_tokens=capacity,
        stalls=stalls,
        stalled_seconds=stalled,
        lost_tokens=lost,
        checkpoint_seconds=checkpoint_seconds,
        replace_seconds=replace_seconds,
        restart_seconds=cfg.restart_seconds,
    )
