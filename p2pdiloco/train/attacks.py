"""Poisoned outer deltas, for tests, the simulator, benchmarks and the demo's ``--adversary``.

Each attack turns what an attacker could know (its own honest delta, and for the omniscient
attacks the honest deltas of the round) into the delta it sends. An attack is a transform of
the attacker's own delta *before* it is compressed and sent (``Attacker.transform``), the same
object in a network learner (``train/learner.py``) and in the simulator; the syncers' merge
never knows who attacks. Shapes: M learners, D parameters, B colluding attackers (a delta's
tensors flattened in sorted-name order); ``honest_MD`` holds the honest learners' deltas of the
round, ``coalition_BD`` the colluding attackers' own (unpoisoned) deltas.

| name      | sends                                                                  | source |
|-----------|------------------------------------------------------------------------|--------|
| sign-flip | −s · own delta                                                         | classic |
| scale     | λ · own delta (λ large)                                                | classic |
| noise     | own delta + N(0, σ²) with σ = ν · rms(own delta)                        | classic |
| alie      | μ − z·σ per coordinate over the honest deltas, z from n and f          | Baruch et al. 2019, "A Little Is Enough" |
| ipm       | −ε · mean of the honest deltas                                          | Xie et al. 2020, inner-product manipulation |
| replay    | a delta from an earlier round (stale base)                              | caught by version checks |
| mimic     | a copy of one honest learner's delta (the most outlying one, kept)     | Karimireddy et al. 2022 |
| collude   | one vector all attackers share: −c · median norm · unit(mean)          | adaptive, screening-aware |
| inflate   | its honest delta, with a signed claim of 10⁶ steps (tokens to match)   | clipped to H (`plausible_claim`) |

``jitter`` (any attack, default 0): each attacker adds its own Gaussian noise of ``jitter`` ×
the honest deltas' per-coordinate std, so copies of one vector stop being copies: the evasion
of clone folding (``sync.clones``, ADR 0036) whose cost the Byzantine bench measures.

``mimic`` over-weights one honest learner's data (Karimireddy, He and Jaggi 2022, "Byzantine-robust
learning on heterogeneous datasets via bucketing"): every attacker copies the same honest
delta, the one farthest from the honest mean in the first round it sees, and follows that
learner from then on. It needs the honest deltas; a lone network attacker has none and sends
its own delta unchanged. ``collude`` is a coalition that pools its members' own deltas (and the
honest ones, when it sees them): each member sends the same vector, the pool's mean direction
reversed, with c (2.9) times the pool's median norm, just inside the default norm screening
(3 × the median): identical copies, so a coordinate-wise rule that trims f < B of them keeps
the rest. Without a pool (a lone network attacker) it is a 2.9× sign flip.
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
    collude_norm: float = 2.9  # c: the shared vector's norm / the pool's median norm
    jitter: float = 0.0  # each attacker's own noise, × the honest per-coordinate std
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
    coalition_BD: torch.Tensor | None = None,
    mimic_row: int = 0,
) -> torch.Tensor:
    """The delta an attacker sends this round (float32, shape of ``own_D``).

    ``mimic`` copies row ``mimic_row`` of ``honest_MD`` (``own_D`` if it has no rows);
    ``collude`` pools ``honest_MD`` and ``coalition_BD`` (``own_D`` alone if both are empty).
    """
    own = own_D.float()
    if cfg.kind == "mimic":
        return (honest_MD[mimic_row] if len(honest_MD) else own).float().clone()
    if cfg.kind == "collude":
        return collude(cfg, own, honest_MD, coalition_BD)
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


def collude(
    cfg: AttackConfig,
    own_D: torch.Tensor,
    honest_MD: torch.Tensor,
    coalition_BD: torch.Tensor | None,
) -> torch.Tensor:
    """The coalition's shared vector: −c · median norm · unit(mean) over the pooled deltas.

    Every member that pools the same rows in the same order sends the same bits.
    """
    parts = [p.float() for p in (honest_MD, coalition_BD) if p is not None and len(p)]
    pool_PD = torch.cat(parts) if parts else own_D.float().unsqueeze(0)
    mean_D = pool_PD.mean(0)
    size = mean_D.norm().item()
    if size == 0:
        return torch.zeros_like(mean_D)
    median_norm = pool_PD.norm(dim=1).median().item()
    return mean_D * (-cfg.collude_norm * median_norm / size)


def mimic_target(honest_MD: torch.Tensor) -> int:
    """The row of ``honest_MD`` farthest from the honest mean (first on ties): the learner a
    ``mimic`` attacker follows."""
    spread_M = (honest_MD.float() - honest_MD.float().mean(0)).norm(dim=1)
    return int(torch.argmax(spread_M).item())


class Attacker:
    """One attacking learner: turns its own delta into the one it sends, round after round.

    ``num_learners`` and ``num_attackers`` are what ALIE's shift is computed for (the attacker's
    belief about the round). ``transform`` takes the attacker's own honest delta and, for an
    omniscient attacker (the simulator), the honest learners' deltas of the round; a lone network
    attacker passes None and the honest spread is estimated from its own current and previous
    delta (half of the current one in its first round). ``replay`` sends its previous delta of
    the same tensors (its own in the first round). ``mimic`` picks its honest learner (by
    position in ``honest``) the first time it sees honest deltas and follows it after; without
    them it sends its own delta. ``collude`` also takes ``coalition``: every colluding
    attacker's own delta of the round, the same list in the same order for each member, so all
    send one vector. State: the previous delta per set of tensor names, so the simulator's
    fragments are kept apart, and the mimicked learner. Raises ValueError for an empty delta or
    ``honest``/``coalition`` deltas without the attacker's tensors.
    """

    def __init__(
        self, cfg: AttackConfig, *, num_learners: int, num_attackers: int = 1, member: int = 0
    ) -> None:
        if not 1 <= num_attackers <= num_learners:
            raise ValueError("an attack needs 1 ≤ num_attackers ≤ num_learners")
        self.cfg = cfg
        self.num_learners = num_learners
        self.num_attackers = num_attackers
        self.member = member  # seeds this attacker's jitter apart from the coalition's others
        self._previous: dict[tuple[str, ...], torch.Tensor] = {}
        self._mimic: int | None = None  # position in ``honest`` of the learner mimicked

    @torch.no_grad()
    def transform(
        self,
        own: Mapping[str, torch.Tensor],
        honest: Sequence[Mapping[str, torch.Tensor]] | None,
        round_index: int,
        coalition: Sequence[Mapping[str, torch.Tensor]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The delta to send this round instead of ``own`` (float32, same names and shapes)."""
        names = tuple(sorted(own))
        if not names:
            raise ValueError("an attacker needs a non-empty delta")
        own_D = torch.cat([own[n].float().reshape(-1) for n in names])
        previous_D = self._previous.get(names)
        if honest:
            honest_MD = _flat(honest, names)
            if self.cfg.kind == "mimic" and (self._mimic is None or self._mimic >= len(honest)):
                self._mimic = mimic_target(honest_MD)
        elif self.cfg.kind in ("mimic", "collude"):
            honest_MD = own_D.new_zeros((0, own_D.numel()))  # nothing seen: no estimate either
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
            coalition_BD=_flat(coalition, names) if coalition else None,
            mimic_row=self._mimic or 0,
        )
        if self.cfg.jitter and len(honest_MD) > 1:
            gen = torch.Generator().manual_seed(
                (self.cfg.seed * 1_000_003 + round_index) * 4099 + self.member
            )
            sigma_D = honest_MD.float().std(0, unbiased=False)
            bad_D = bad_D + self.cfg.jitter * sigma_D * torch.randn(bad_D.shape, generator=gen)
        self._previous[names] = own_D
        return _unflat(bad_D, own, names)


def _flat(deltas: Sequence[Mapping[str, torch.Tensor]], names: tuple[str, ...]) -> torch.Tensor:
    return torch.stack([torch.cat([d[n].float().reshape(-1) for n in names]) for d in deltas])


def _unflat(
    bad_D: torch.Tensor, own: Mapping[str, torch.Tensor], names: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for n in names:
        size = own[n].numel()
        out[n] = bad_D[offset : offset + size].reshape(own[n].shape)
        offset += size
    return out
