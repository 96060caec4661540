"""Stopping a batch loop mid-way in a test: the model's ``forward`` counts the batches and
calls ``stop`` as a chosen one starts, as a node's stop arrives while a merge scores or
evaluates (``sync.stopping``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def stop_at_batch(
    model: torch.nn.Module, stop: Callable[[], None], at: int = 2
) -> Iterator[list[int]]:
    """Within the block, ``stop()`` is called as batch ``at`` starts; yields the list of
    batches run (one entry each). ``forward`` is restored on leaving."""
    forward, batches = model.forward, []

    def counting(*args: Any, **kw: Any) -> Any:
        batches.append(1)
        if len(batches) == at:
            stop()
        return forward(*args, **kw)

    model.forward = counting  # type: ignore[method-assign]
    try:
        yield batches
    finally:
        model.forward = forward  # type: ignore[method-assign]
