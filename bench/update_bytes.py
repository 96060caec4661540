"""Download bytes per certified version of a node off the committee: the certified update
against the full state (ADR 0029).

Whole nodes in one process (``testing.memnet.MemoryNetwork``, gemma-tiny): four learners form
the committee, a fifth node trains nothing, so it is never elected and follows every version
as a learner outside the committee does. Its bytes are counted at the in-memory transport
(every frame it received: replies to its requests, and the few requests peers sent it),
divided by the versions it applied. ``--mode full`` makes every peer refuse the ``update`` op,
so the follower downloads each state whole (the path of every version before ADR 0029).

    .venv/bin/python bench/update_bytes.py                      # none and int8 updates, full
    .venv/bin/python bench/update_bytes.py --codec int8 --versions 4 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from p2pdiloco.net.sync_rpc import RpcRefused
from p2pdiloco.net.transport import MemoryHub
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.testing.memnet import MemoryNetwork


def refuse_updates(hub: MemoryHub) -> None:
    for peer, (handler, limits, screen) in list(hub.handlers.items()):

        async def no_update(
            op: str, src: str, control: dict[str, Any], frames: list[bytes], handler: Any = handler
        ) -> Any:
            if op == "update":
                raise RpcRefused(Reason.NOT_FOUND, "updates off (bench)")
            return await handler(op, src, control, frames)

        hub.handlers[peer] = (no_update, limits, screen)


async def measure(codec: str, mode: str, versions: int, workdir: Path) -> dict[str, Any]:
    async with MemoryNetwork(
        workdir, nodes=5, committee_size=4, learners=4, rules={"update_codec": codec}
    ) as net:
        follower = net.nodes[4]
        if mode == "full":
            refuse_updates(net.hub)
        await net.wait_for(lambda: follower.version >= 1, 120, "version 1")
        start_v, start_b = follower.version, net.hub.received.get(follower.peer_id, 0)
        await net.wait_for(lambda: follower.version >= start_v + versions, 300, "versions")
        applied = follower.version - start_v
        got = net.hub.received.get(follower.peer_id, 0) - start_b
        state = follower.runtime.chain.current
        assert state is not None
        tally = follower.runtime.tally
        return {
            "update_codec": codec,
            "mode": mode,
            "versions": applied,
            "bytes_per_version": got / applied,
            "state_bytes": state.blob().index.total_bytes,
            "update_bytes": len(state.update) if state.update is not None else None,
            "by_update": tally.updates,
            "full_downloads": len(tally.downloads),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codec", action="append", help="update codec (repeatable)")
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    runs = [(c, "update") for c in a.codec or ["none", "int8"]] + [("int8", "full")]
    for codec, mode in runs:
        with tempfile.TemporaryDirectory() as d:
            rows.append(asyncio.run(measure(codec, mode, a.versions, Path(d))))
    if a.json:
        json.dump(rows, sys.stdout, indent=2)
        return
    print(f"{'mode':>7} {'codec':>6} {'versions':>8} {'MB/version':>10} {'state MB':>9}")
    for r in rows:
        print(
            f"{r['mode']:>7} {r['update_codec']:>6} {r['versions']:>8} "
            f"{r['bytes_per_version'] / 1e6:>10.3f} {r['state_bytes'] / 1e6:>9.3f}"
        )


if __name__ == "__main__":
    main()
