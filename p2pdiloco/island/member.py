"""A member of an island (rank ≥ 1): started by rank 0's ``join``, it trains its rows of each
step and holds its shards, and never speaks to the network.

    python -m p2pdiloco.island.member --store HOST:PORT --id 1 [--device cpu] [--threads 1]

It waits for each generation's plan, joins that generation's process group, and runs the
commands rank 0 posts (``channel.run_op``) until ``stop``. When a collective fails (another
member died) or rank 0 posts ``reform``, it waits for the next generation's plan; a plan that
leaves it out, or rank 0 gone, ends it. Exit status 0 in every one of those cases.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys

import torch
import torch.distributed as dist

from p2pdiloco.island import channel

log = logging.getLogger("p2pdiloco.island.member")


def serve_generation(
    store: dist.Store, gen: int, plan: dict, rank: int, device: torch.device, parent: int
) -> str:
    """Run generation ``gen``'s commands; 'stop', 'reform' or 'gone' (rank 0 went away)."""
    dist.init_process_group(
        plan["backend"],
        store=channel.pg_store(store, gen),
        rank=rank,
        world_size=len(plan["ranks"]),
        timeout=datetime.timedelta(seconds=float(plan["timeout_s"])),
    )
    try:
        shards = channel.shards_for(plan, device)
        seq = 0
        while True:
            raw = channel.wait_for(store, channel.cmd_key(gen, seq), parent)
            if raw is None:
                return "gone"
            cmd = channel.decode(raw)
            seq += 1
            if cmd["op"] in ("stop", "reform"):
                return str(cmd["op"])
            try:
                channel.run_op(shards, cmd)
            except FloatingPointError as e:  # every rank raised at that step; rank 0 decides
                log.info("%s", e)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p2pdiloco.island.member")
    ap.add_argument("--store", required=True, help="rank 0's store, HOST:PORT")
    ap.add_argument("--id", type=int, required=True, help="this member's id (1, 2, ...)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s member {args.id}: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host, _, port = args.store.rpartition(":")
    parent = os.getppid()
    store = dist.TCPStore(
        host, int(port), is_master=False, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    gen = 0
    while True:
        raw = channel.wait_for(store, channel.gen_key(gen), parent)
        if raw is None:
            log.info("rank 0 is gone: stopping")
            return 0
        plan = channel.decode(raw)
        rank = plan["ranks"].get(str(args.id))
        if rank is None:
            log.info("generation %d leaves this member out: stopping", gen)
            return 0
        log.info("generation %d: rank %d of %d", gen, rank, len(plan["ranks"]))
        try:
            how = serve_generation(store, gen, plan, rank, device, parent)
        except (RuntimeError, dist.DistError) as e:  # a member died mid-collective
            log.info("generation %d broke (%s): waiting for the next", gen, str(e)[:200])
            how = "reform"
        if how != "reform":
            log.info("generation %d ended: %s", gen, how)
            return 0
        gen += 1


if __name__ == "__main__":
    sys.exit(main())
