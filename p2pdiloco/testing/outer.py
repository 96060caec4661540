"""The outer optimizer as one object over whole tensors: the reference the windowed merge is
checked against.

The network applies the outer step window by window inside the merge
(``sync.aggregator.merge_round`` calling ``train.outer.outer_update_``); the tests and
``bench/merge_memory.py`` compare its bits with this plain form, which steps every tensor of a
merged pseudo-gradient at once and keeps the momentum buffers itself.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from p2pdiloco.train.configs import OuterConfig
from p2pdiloco.train.outer import MOMENTUM_PREFIX, outer_update_


class OuterOptimizer:
    """Nesterov SGD on merged pseudo-gradients, keeping one fp32 momentum buffer per tensor.

    The buffers are part of the certified global state (``state_tensors``), so a new syncer
    committee continues exactly where the last one stopped.
    """

    def __init__(self, cfg: OuterConfig) -> None:
        self.cfg = cfg
        self.momentum: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(
        self, params: Mapping[str, torch.Tensor], merged_delta: Mapping[str, torch.Tensor]
    ) -> None:
        """Update ``params`` in place for every tensor named in ``merged_delta``.

        Raises KeyError for a delta naming an unknown tensor and ValueError on a shape
        mismatch, before any tensor is modified.
        """
        for n, d in merged_delta.items():
            if tuple(params[n].shape) != tuple(d.shape):
                raise ValueError(f"delta '{n}' has shape {tuple(d.shape)}, param {params[n].shape}")
        for n, delta in merged_delta.items():
            p = params[n]
            g = delta.to(device=p.device, dtype=torch.float32)
            buf = self.momentum.get(n)
            if buf is None:
                buf = torch.zeros_like(g)
                self.momentum[n] = buf
            outer_update_(p, buf, g, self.cfg)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Momentum buffers keyed ``outer.momentum.<param name>``."""
        return {MOMENTUM_PREFIX + n: b for n, b in self.momentum.items()}

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore buffers saved by ``state_tensors`` (other keys are ignored)."""
        self.momentum = {
            k[len(MOMENTUM_PREFIX) :]: v.float().clone()
            for k, v in tensors.items()
            if k.startswith(MOMENTUM_PREFIX)
        }
