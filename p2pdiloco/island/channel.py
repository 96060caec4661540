"""The island's command channel: rank 0 posts, the other ranks read, through one TCPStore.

Rank 0 (the ``join`` process) hosts the store. For each generation ``g`` of the island it
posts the plan (``gen/g``: every member's rank, the model, the inner config, where the learning
rate schedule stands) and the process group of that generation rendezvouses under ``g{g}/pg``.
Then it posts numbered commands (``g{g}/cmd/0``, ``/1``, ...) that every rank runs in the same
order (``run_op``): each is a collective, so the members never wait in one for a command rank
0 did not send, and no collective timeout runs while rank 0 waits on the network.

Values are written with ``torch.save`` and read with ``weights_only=True``: a blob holds
plain values and tensors only, so a bad one is refused with an error, never executed. The
store is sealed with the island's secret (``island.sealed``): a value nobody of the island
wrote fails its check before it is read.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from p2pdiloco.island.shards import Shards
from p2pdiloco.train.configs import InnerConfig

OPS = ("scatter", "gather", "train", "seek", "reform", "stop")
MEMBERS = "members"  # counter: member ids are handed out by incrementing it
GENS = "gens"  # counter: generations formed so far
JOIN = "join"  # queue: another host's member pushes its sealed id to register
JOINS_PER_LOOK = 64  # registrations rank 0 reads at a time: a flood of junk waits its turn
BEAT = 0.5


def beat_key(member: int) -> str:
    """A member's beat: a sealed, increasing count it writes every ``BEAT`` seconds."""
    return f"beat/{member}"


def gen_key(gen: int) -> str:
    return f"gen/{gen}"


def cmd_key(gen: int, seq: int) -> str:
    return f"g{gen}/cmd/{seq}"


def pg_store(store: dist.Store, gen: int) -> dist.Store:
    """The store a generation's process group rendezvouses in (its own key space)."""
    return dist.PrefixStore(f"g{gen}/pg", store)


def encode(value: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def put(store: dist.Store, key: str, value: dict[str, Any]) -> None:
    store.set(key, encode(value))  # type: ignore[arg-type]  # bytes are accepted (stub: str)


def decode(raw: bytes) -> dict[str, Any]:
    value = torch.load(io.BytesIO(raw), weights_only=True)
    if not isinstance(value, dict) or value.get("op", "plan") not in (*OPS, "plan"):
        raise ValueError("not an island command")
    return value


def plan(
    ranks: dict[str, int],
    model: str,
    seed: int,
    cfg: InnerConfig,
    global_step: int,
    backend: str,
    timeout_s: float,
    micro_batch: int | None,
    checkpointing: bool = False,
    offload: bool = False,
) -> dict[str, Any]:
    return {
        "checkpointing": checkpointing,
        "offload": offload,
        "op": "plan",
        "ranks": ranks,
        "model": model,
        "seed": seed,
        "cfg": asdict(cfg),
        "global_step": global_step,
        "backend": backend,
        "timeout_s": timeout_s,
        "micro_batch": micro_batch,
    }


def shards_for(p: dict[str, Any], device: torch.device) -> Shards:
    """This rank's shards for generation plan ``p`` (the process group is up)."""
    cfg = InnerConfig(**p["cfg"])
    return Shards(
        p["model"],
        p["seed"],
        cfg,
        global_step=p["global_step"],
        device=device,
        micro_batch=p["micro_batch"],
        checkpointing=bool(p.get("checkpointing")),
        offload=bool(p.get("offload")),
    )


def run_op(shards: Shards, cmd: dict[str, Any], full: Any = None) -> Any:
    """Run this rank's part of ``cmd``: every rank calls it for every command, in order.
    ``full``: rank 0's parameters for ``scatter``."""
    op = cmd["op"]
    if op == "scatter":
        return shards.scatter(full)
    if op == "gather":
        return shards.gather()
    if op == "train":
        return shards.train(cmd["batches"])
    if op == "seek":
        shards.seek(int(cmd["step"]))
        return dist.barrier()
    raise ValueError(f"unknown island command {op!r}")


def wait_for(
    store: dist.Store,
    key: str,
    parent: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> bytes | None:
    """The value of ``key`` once rank 0 posts it; None once rank 0 is gone (its store closed,
    or, on its host, the process that started this one exited) or ``stop()`` says so."""
    while True:
        try:
            if store.check([key]):
                return store.get(key)
        except dist.DistNetworkError:
            return None
        if parent is not None and os.getppid() != parent:
            return None
        if stop is not None and stop():
            return None
        time.sleep(0.02)
