"""Shared fixtures: offline hub, and no child process outlives its test."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import psutil
import pytest

# Tests never touch the network: the hub is off for transformers/huggingface_hub/datasets.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _kill_leftover_children() -> Iterator[None]:
    yield
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(children, timeout=10)
