"""Poisoned outer deltas, for tests, the simulator, benchmarks and the demo's ``--adversary``.

Each attack turns what an attacker could know (its own honest delta, and for the omniscient
attacks the honest deltas of the round) into the delta it sends. Shapes: M learners, D
parameters; ``honest_MD`` holds the honest learners' deltas of the round.

| name      | sends                                                                  | source |
|-----------|------------------------------------------------------------------------|--------|
| sign-flip | −s · own delta                                                         | classic |
| scale     | λ · own delta (λ large)                                                | classic |
| noise     | own delta + N(0, σ²) with σ = ν · rms(own delta)                        | classic |
| alie      | μ − z·σ per coordinate over the honest deltas, z from n and f          | Baruch et al. 2019, "A Little Is Enough" |
| ipm       | −ε · mean of the honest deltas                                          | Xie et al. 2020, inner-product manipulation |
| replay    | a delta from an earlier round (stale base)                              | caught by version checks |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

ATTACKS = ("sign-flip", "scale", "noise", "alie", "ipm", "replay")


@dataclass(frozen=True)
class AttackConfig:
    kind: str
    flip_scale: float = 4.0  # sign-flip multiplier s
    scale: float = 20.0  # λ of the scaling attack
    noise: float = 10.0  # ν: noise std relative to the delta's rms
    ipm_epsilon: float = 0.5  # ε of inner-product manipulation
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ValueError(f"unknown attack '{self.kind}'; choose one of {', '.join(ATTACKS)}")


def alie_z(n: int, f: int) -> float:
    """ALIE's z_max: the largest shift that stays inside the honest spread for n learners, f bad."""
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    p = min(max(p, 1e-6), 1 - 1e-6)
    return NormalDist().inv_cdf(p)


def poison(
    cfg: AttackConfig,
    own_D: torch.Tensor,
    honest_MD: torch.Tensor,
    *,
    num_learners: int,
    num_attackers: int,
    previous_D: torch.Tensor | None = None,
    round_index: int = 0,
) -> torch.Tensor:
    """The delta an attacker sends this round (float32, shape of ``own_D``)."""
    own = own_D.float()
    if cfg.kind == "sign-flip":
        return -cfg.flip_scale * own
    if cfg.kind == "scale":
        return cfg.scale * own
    if cfg.kind == "noise":
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + round_index)
        rms = own.pow(2).mean().sqrt().item() or 1e-8
        return own + cfg.noise * rms * torch.randn(own.shape, generator=gen)
    if cfg.kind == "alie":
        mu, sigma = honest_MD.float().mean(0), honest_MD.float().std(0, unbiased=False)
        return mu - alie_z(num_learners, num_attackers) * sigma
    if cfg.kind == "ipm":
        return -cfg.ipm_epsilon * honest_MD.float().mean(0)
    # replay: the attacker re-sends an old delta; in the network its stale base version gets it
    # rejected, in a version-blind simulation it is simply an outdated update.
    return (previous_D if previous_D is not None else own).float().clone()
