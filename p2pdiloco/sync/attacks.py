"""Poisoned outer deltas, for tests, the simulator, benchmarks and the demo's ``--adversary``.

Each attack turns what an attacker could know (its own honest delta, and for the omniscient
attacks the honest deltas of the round) into the delta it sends. An attack is a transform of
the attacker's own delta *before* it is compressed and sent (``Attacker.transform``), the same
object in a network learner (``train/learner.py``) and in the simulator; the syncers' merge
never knows who attacks. Shapes: M learners, D parameters (a delta's tensors flattened in
sorted-name order); ``honest_MD`` holds the honest learners' deltas of the round.

| name      | sends                                                                  | source |
|-----------|------------------------------------------------------------------------|--------|
| sign-flip | −s · own delta                                                         | classic |
| scale     | λ · own delta (λ large)                                                | classic |
| noise     | own delta + N(0, σ²) with σ = ν · rms(own delta)                        | classic |
| alie      | μ − z·σ per coordinate over the honest deltas, z from n and f          | Baruch et al. 2019, "A Little Is Enough" |
| ipm       | −ε · mean of the honest deltas                                          | Xie et al. 2020, inner-product manipulation |
| replay    | a delta from an earlier round (stale base)                              | caught by version checks |
| inflate   | its honest delta, with a signed claim of 10⁶ steps (tokens to match)   | clipped to H (`plausible_claim`) |
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import torch

from p2pdiloco import choices

ATTACKS = choices.ATTACKS  # the names, kept where the command line reads them without torch
INFLATED_STEPS = 10**6  # the steps an ``inflate`` attacker claims per delta


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
    if cfg.kind == "inflate":  # the lie is in the header (runtime/trainer.py), not the delta
        return own.clone()
    # replay: the attacker re-sends an old delta; in the network its stale base version gets it
    # rejected, in a version-blind simulation it is simply an outdated update.
    return (previous_D if previous_D is not None else own).float().clone()


class Attacker:
    """One attacking learner: turns its own delta into the one it sends, round after round.

    ``num_learners`` and ``num_attackers`` are what ALIE's shift is computed for (the attacker's
    belief about the round). ``transform`` takes the attacker's own honest delta and, for an
    omniscient attacker (the simulator), the honest learners' deltas of the round; a lone network
    attacker passes None and the honest spread is estimated from its own current and previous
    delta (half of the current one in its first round). ``replay`` sends its previous delta of
    the same tensors (its own in the first round). State: the previous delta per set of tensor
    names, so the simulator's fragments are kept apart. Raises ValueError for an empty delta or
    ``honest`` deltas without the attacker's tensors.
    """

    def __init__(self, cfg: AttackConfig, *, num_learners: int, num_attackers: int = 1) -> None:
        if not 1 <= num_attackers <= num_learners:
            raise ValueError("an attack needs 1 ≤ num_attackers ≤ num_learners")
        self.cfg = cfg
        self.num_learners = num_learners
        self.num_attackers = num_attackers
        self._previous: dict[tuple[str, ...], torch.Tensor] = {}

    @torch.no_grad()
    def transform(
        self,
        own: Mapping[str, torch.Tensor],
        honest: Sequence[Mapping[str, torch.Tensor]] | None,
        round_index: int,
    ) -> dict[str, torch.Tensor]:
        """The delta to send this round instead of ``own`` (float32, same names and shapes)."""
        names = tuple(sorted(own))
        if not names:
            raise ValueError("an attacker needs a non-empty delta")
        own_D = torch.cat([own[n].float().reshape(-1) for n in names])
        previous_D = self._previous.get(names)
        if honest:
            honest_MD = torch.stack(
                [torch.cat([h[n].float().reshape(-1) for n in names]) for h in honest]
            )
        else:
            estimate = previous_D if previous_D is not None else own_D * 0.5
            honest_MD = torch.stack([own_D, estimate])
        bad_D = poison(
            self.cfg,
            own_D,
            honest_MD,
            num_learners=self.num_learners,
            num_attackers=self.num_attackers,
            previous_D=previous_D,
            round_index=round_index,
        )
        self._previous[names] = own_D
        out, offset = {}, 0
        for n in names:
            size = own[n].numel()
            out[n] = bad_D[offset : offset + size].reshape(own[n].shape)
            offset += size
        return out
