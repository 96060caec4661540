"""``join``'s island parts: the plan printed before joining, and a host serving another's LAN
island as a member (``--lan-island``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from p2pdiloco.errors import UserError
from p2pdiloco.island.lan import serve_as_member
from p2pdiloco.island.spec import IslandSpec, check_island_fits
from p2pdiloco.node import Node
from p2pdiloco.train.device import resolve_device


def plan_island_for(model: str, spec: IslandSpec, available: int | None) -> IslandSpec:
    """Say how ``model`` trains on the island and return the spec following that plan
    (activation checkpointing where it needs it); refuse in one line (ModelTooLarge) unless the
    island is open to its LAN, which may grow to the size it needs."""
    per_rank = available or _per_rank_memory(spec)
    try:
        line, checkpointing = check_island_fits(model, spec, per_rank, _host_memory(spec))
    except UserError as e:
        if not spec.lan:
            raise
        print(f"island: {e} (this host; LAN members add theirs)", flush=True)
        return replace(spec, checkpointing=True)
    print(f"island: {line}", flush=True)
    return replace(spec, checkpointing=checkpointing)


def serve_lan_member(node: Node, leader: Any, secret: bytes, device: str, stop: Any) -> None:
    """This host serves another's LAN island as a member (no learner of its own), heartbeating
    in the run meanwhile, until rank 0 stops or goes, or Ctrl-C."""
    from p2pdiloco.runtime.launch import RunningNode, TrainConfig

    print(
        f"island {leader.island}: joining {leader.peer_id[:16]}'s island at {leader.store} "
        f"as a member ({leader.backend}, {leader.ranks} ranks now)",
        flush=True,
    )
    membership = RunningNode(node, TrainConfig(state_dir=Path("."), train=False))
    membership.start()
    try:
        member = serve_as_member(leader, secret, device, stop)
    finally:
        membership.stop()
    print(f"stopped (island member {member})", flush=True)


def _host_memory(spec: IslandSpec) -> int | None:
    """What this host (rank 0's) has free for the DiLoCo state beside a GPU island; None on a
    gloo island, whose ranks' share of the host already counts it."""
    from p2pdiloco.train.memory import available_memory

    return available_memory(resolve_device("cpu"))[0] if spec.backend == "nccl" else None


def _per_rank_memory(spec: IslandSpec) -> int:
    """Bytes one rank may use: its GPU's free memory, or on CPU the host's shared by all."""
    from p2pdiloco.train.memory import available_memory

    if spec.backend == "nccl":
        return min(available_memory(resolve_device(d))[0] for d in spec.devices)
    return available_memory(resolve_device("cpu"))[0] // spec.ranks
