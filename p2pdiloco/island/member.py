"""A member of an island (rank ≥ 1): it trains its rows of each step and holds its shards, and
never speaks to the network.

    python -m p2pdiloco.island.member --store HOST:PORT --secret-stdin [--id 1] [--device cpu]

Started by rank 0's ``join`` on its own host (with ``--id``), or run by ``join --lan-island`` on
another host of the LAN (``run_member``, which registers for an id). It beats a counter in the
store while it runs, waits for each generation's plan, joins that generation's process group,
and runs the commands rank 0 posts (``channel.run_op``) until ``stop``. When a collective fails
(another member died) or rank 0 posts ``reform``, it waits for the next generation. A plan that
leaves it out after it has served, rank 0 gone, or ``stop()``, ends it (exit status 0).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from p2pdiloco.island import channel
from p2pdiloco.island.sealed import IslandAuthError, SealedStore
from p2pdiloco.island.secret import parse_secret

log = logging.getLogger("p2pdiloco.island.member")


def serve_generation(
    store: dist.Store,
    gen: int,
    plan: dict,
    rank: int,
    device: torch.device,
    wait: Callable[[str], bytes | None],
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
            raw = wait(channel.cmd_key(gen, seq))
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


def _beat(address: tuple[str, int], secret: bytes, member: int, done: threading.Event) -> None:
    """Write this member's sealed, increasing beat every ``channel.BEAT`` s (its own
    connection)."""
    try:
        conn = dist.TCPStore(address[0], address[1], is_master=False, wait_for_workers=False)
        store, beat = SealedStore(conn, secret), 0
        while not done.wait(channel.BEAT):
            beat += 1
            store.set(channel.beat_key(member), str(beat))
    except dist.DistError:
        return  # rank 0 is gone: the main loop notices too


def run_member(
    store_addr: str,
    secret: bytes,
    *,
    member_id: int | None = None,
    device: torch.device | None = None,
    parent: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> int:
    """Serve rank 0 at ``store_addr`` until it stops us or goes; returns the member id.
    ``secret``: the island's (its store is sealed with it, ``island.sealed``); without it rank
    0 refuses the registration. ``member_id``: given by rank 0 to its own children; None
    registers for one."""
    device = device or torch.device("cpu")
    host, _, port = store_addr.rpartition(":")
    conn = dist.TCPStore(
        host,
        int(port),
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    store = SealedStore(conn, secret)
    if member_id is None:  # another host's: its first generation is the next one formed
        member_id, gen = store.add(channel.MEMBERS, 1), store.add(channel.GENS, 0)
        store.push(channel.JOIN, str(member_id).encode())
    else:
        gen = 0
    done = threading.Event()
    threading.Thread(
        target=_beat, args=((host, int(port)), secret, member_id, done), daemon=True, name="beat"
    ).start()

    def wait(key: str) -> bytes | None:
        return channel.wait_for(store, key, parent, stop)

    served = False
    try:
        while True:
            try:
                raw = wait(channel.gen_key(gen))
            except IslandAuthError as e:  # spoiled by someone without the secret: rank 0
                log.warning("%s (reason: island_auth_failed)", e)  # re-forms without it
                gen += 1
                continue
            if raw is None:
                log.info("rank 0 is gone: stopping")
                return member_id
            plan = channel.decode(raw)
            rank = plan["ranks"].get(str(member_id))
            if rank is None and served:
                log.info("generation %d leaves this member out: stopping", gen)
                return member_id
            if rank is None:  # formed before we registered: wait for the next
                gen += 1
                continue
            served = True
            log.info("generation %d: rank %d of %d", gen, rank, len(plan["ranks"]))
            try:
                how = serve_generation(store, gen, plan, rank, device, wait)
            except (RuntimeError, dist.DistError, IslandAuthError) as e:
                # A member died mid-collective, or a command was spoiled by someone without
                # the secret (never run): rank 0 re-forms the island.
                log.info("generation %d broke (%s): waiting for the next", gen, str(e)[:200])
                how = "reform"
            if how != "reform":
                log.info("generation %d ended: %s", gen, how)
                return member_id
            gen += 1
    finally:
        done.set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p2pdiloco.island.member")
    ap.add_argument("--store", required=True, help="rank 0's store, HOST:PORT")
    ap.add_argument("--id", type=int, default=None, help="given by rank 0 to its children")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--secret-stdin", action="store_true", help="read the island's secret (hex) from stdin"
    )
    args = ap.parse_args(argv)
    if not args.secret_stdin:
        ap.error("the island's secret comes on stdin (--secret-stdin): rank 0 starts members")
    secret = parse_secret(sys.stdin.readline())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s member: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parent = os.getppid() if args.id is not None else None
    run_member(args.store, secret, member_id=args.id, device=device, parent=parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
