"""``bench/gpu_island.py`` with bf16 autocast's weight-cast cache off (ADR 0049's check).

The island plan counts every bf16 weight copy autocast made as held, unsharded, to the end of
the forward (autocast caches them until its context exits). With the cache off, the measured
peak per checkpointed decoder layer loses those 2 B per parameter (on an H200, gemma-12b's layer
at 1 × 4096: 3.41 GiB against 3.82 with the cache; docs/data/gpu_island_plan_h200.json):

    python bench/gpu_island_nocache.py --device cuda --model gemma-12b --layers 6,10 \\
        --mode fsdp --checkpointing --seq-len 4096 --micro-batch 1 --step-batch 2 --steps 2
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Iterator

import torch

import p2pdiloco.train.inner as inner


@contextlib.contextmanager
def autocast_nocache(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            yield
    else:
        yield


inner.autocast_for = autocast_nocache
sys.argv = ["bench/gpu_island.py", *sys.argv[1:]]
runpy.run_path("bench/gpu_island.py", run_name="__main__")
