"""The aggregation-rule plug-in point (``AggregationRule``) and the validation of its inputs and
hyperparameters.

A rule computes with the arithmetic of ``exact.py`` only: its determinism contract is what keeps
the aggregates of honest syncers bit-identical. The shape legend is there too (``delta_MD``:
M learners × D parameters).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from .rows import RowSet


def _check_deltas(deltas: torch.Tensor) -> torch.Tensor:
    if not isinstance(deltas, torch.Tensor):
        raise ValueError(f"deltas must be a torch.Tensor [M, D], not {type(deltas).__name__}")
    if deltas.dim() != 2:
        raise ValueError(f"deltas must be 2-D [learners, params], got shape {tuple(deltas.shape)}")
    if deltas.shape[0] < 1:
        raise ValueError("deltas must have at least one learner (row)")
    if not deltas.dtype.is_floating_point:
        raise ValueError(f"deltas must be floating point, got {deltas.dtype}")
    x = deltas.detach()
    if x.dtype != torch.float32:
        x = x.float()  # fp16/bf16 widen exactly; float64 rounds once
    x = x.contiguous()
    if x.numel():
        lo, hi = torch.aminmax(x)  # NaN propagates; ±inf shows as an extreme
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
            bad = (~torch.isfinite(x)).any(dim=1).nonzero().flatten().tolist()
            raise ValueError(f"deltas contain non-finite values in learner rows {bad}")
    return x


def check_weights(weights: torch.Tensor | Sequence[float] | None, m: int) -> list[float] | None:
    if weights is None:
        return None
    w = torch.as_tensor(weights).detach()
    if w.dtype.is_complex or w.dtype == torch.bool:
        raise ValueError(f"weights must be real numbers, got {w.dtype}")
    if tuple(w.shape) != (m,):
        raise ValueError(f"weights must have shape ({m},) for {m} learners, got {tuple(w.shape)}")
    vals = [float(v) for v in w.to(device="cpu", dtype=torch.float64).tolist()]
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"weights must be finite, got {vals}")
    if any(v < 0 for v in vals):
        raise ValueError(f"weights must be non-negative, got {vals}")
    if not math.fsum(vals) > 0:
        raise ValueError("weights must have a positive sum")
    return vals


def check_int(name: str, value: object, minimum: int) -> int:
    """Validate an integer hyperparameter. Integral floats (``2.0``, as parsed from a CLI
    ``KEY=NUMBER``) are accepted; bools and fractional values are not."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")
    return value


def check_positive(name: str, value: object) -> float:
    """Validate a finite positive float hyperparameter."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return v


class AggregationRule(ABC):
    """Merges learners' pseudo-gradients into one, robustly and bit-reproducibly.

    Call it with ``deltas`` float32 [M, D] (other float dtypes are converted to float32) and
    optional ``weights`` [M] (tokens or any non-negative trust weight; None = uniform). It
    returns a new float32 [D] tensor and never modifies its inputs.

    Failure semantics: raises ValueError, before any work, on anything but a finite 2-D float
    tensor with at least one row, on weights that are not [M], finite, non-negative with a
    positive sum, and on fewer learners than the rule needs (``min_learners``). A syncer
    should screen (``screen``) first and treat a ValueError as "no aggregate this round".
    Results are bit-identical across machines and thread counts (see the module docstring).
    """

    name: str = ""
    # Each output coordinate depends on that coordinate of the inputs alone (and the weights):
    # the rule may then run on column windows (``rows.RowSet``) with bit-identical results.
    coordinatewise: bool = False

    def __call__(
        self, deltas: torch.Tensor, weights: torch.Tensor | Sequence[float] | None = None
    ) -> torch.Tensor:
        delta_MD = _check_deltas(deltas)
        w = check_weights(weights, delta_MD.shape[0])
        if delta_MD.shape[0] < self.min_learners:
            raise ValueError(
                f"{self!r} needs at least {self.min_learners} learners, got {delta_MD.shape[0]}"
            )
        with torch.no_grad():
            out_D = self.aggregate(delta_MD, w)
        return out_D

    @property
    def min_learners(self) -> int:
        """Fewest learners the rule accepts (close a round only once this many are screened)."""
        return 1

    def select(
        self, deltas: RowSet, rows: list[int], weights: list[float] | None
    ) -> tuple[list[int], AggregationRule, list[float] | None] | None:
        """For a rule that is not coordinate-wise but is a choice of learners followed by a
        coordinate-wise merge (Krum, multi-Krum): make the choice from ``rows`` of ``deltas``
        (window by window, never stacking them) and return ``(chosen rows, coordinate-wise
        rule, their weights)``, which gives the bits ``aggregate`` gives on the stacked rows.
        None (the default): the rule needs all columns at once."""
        return None

    @abstractmethod
    def aggregate(self, delta_MD: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
        """The rule itself on validated input: contiguous finite float32 [M, D] and validated
        weights (None = uniform). Returns float32 [D]."""

    def params(self) -> dict[str, object]:
        """Hyperparameters, as they would go in a run manifest."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{self.name}({args})"
