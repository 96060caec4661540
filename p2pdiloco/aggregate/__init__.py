"""Robust aggregation of learners' pseudo-gradients, bit-exact across honest syncers.

    rule = get_rule("trimmed_mean", f=2)
    result = screen(deltas, expected_numel=fragment_numel)
    merged_D = rule(deltas_MD[result.accepted], weights_M[result.accepted])

Every rule takes float32 [M, D] deltas (M learners, D parameters of one fragment) and optional
non-negative weights [M], and returns float32 [D]. The determinism contract (how results stay
bit-identical across machines and thread counts) is in ``exact.py``.

Choosing a rule, with b attackers expected among M screened learners:
    mean              no attackers (trusted runs); baseline
    sender_mean       as mean, each coordinate over the learners that sent it (top-k codecs)
    trimmed_mean(f)   f ≥ b, M > 2f; good default against unknown attacks (f ≈ M/4)
    median            b < M/2, no tuning; noisier on honest data
    multi_krum(f, m)  f ≥ b, M > 2f + 2; strong against large or scaled attacks
    krum(f)           as multi_krum with m = 1; slow convergence, mostly for comparison
    centered_clip     b < M/2; tune tau (or relative=True); cheap per iteration
    geometric_median  b < M/2 of the weight; rotation-invariant; no real tuning
"""

from __future__ import annotations

import inspect

from .base import AggregationRule
from .clipping import CenteredClip, ScreenResult, clip_norms, screen
from .geomed import GeometricMedian
from .krum import Krum, MultiKrum
from .mean import Mean, SenderMean
from .order import CoordinateMedian, TrimmedMean

_REGISTRY: dict[str, type[AggregationRule]] = {
    cls.name: cls
    for cls in (
        Mean,
        SenderMean,
        CoordinateMedian,
        TrimmedMean,
        Krum,
        MultiKrum,
        CenteredClip,
        GeometricMedian,
    )
}
RULES: tuple[str, ...] = tuple(_REGISTRY)


def get_rule(name: str, **params: object) -> AggregationRule:
    """Build the rule ``name`` (one of ``RULES``) with hyperparameters ``params``.

    Raises ValueError for an unknown name, an unknown parameter, or an invalid value.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown aggregation rule {name!r}; choose one of {RULES}") from None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = [
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind in kinds and p.name != "self"
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"rule {name!r} takes {accepted or 'no parameters'}, not {unknown}")
    return cls(**params)  # type: ignore[arg-type]


__all__ = [
    "RULES",
    "AggregationRule",
    "CenteredClip",
    "CoordinateMedian",
    "GeometricMedian",
    "Krum",
    "Mean",
    "MultiKrum",
    "ScreenResult",
    "SenderMean",
    "TrimmedMean",
    "clip_norms",
    "get_rule",
    "screen",
]
