"""Bytes a learner uploads per delta, and what the committee relays for it (issue 11 item 2).

A whole run in one process (``testing.memnet``: real runtimes, syncers, learners, signatures
and gemma-tiny tensors over the in-memory transport, whose hub sees every request). Each
``submit`` request is classed by who sends it: the learner's own upload (it asks for a relay)
or a member's relay. Counted are the request frames as sent (signed header + payload), of
requests the receiver answered.

    .venv/bin/python bench/uploads.py                      # 8 nodes, committees of 4, 3 versions
    .venv/bin/python bench/uploads.py --nodes 6 --committee 3 --versions 4 --json

Before this change a learner sent every delta to every member: k uploads per delta.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.protocol.submissions import open_submission
from p2pdiloco.testing.memnet import MemoryNetwork


async def measure(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    own: Counter[str] = Counter()  # digest → bytes its learner uploaded
    copies: Counter[str] = Counter()  # digest → uploads by its learner
    relayed: Counter[str] = Counter()  # digest → bytes members relayed
    size: dict[str, int] = {}  # digest → bytes of one copy
    by_learner: defaultdict[str, list[str]] = defaultdict(list)
    run_id = ""

    def tap(src: str, dst: str, control: dict[str, Any], frames: list[bytes], reply: Any) -> None:
        if control["op"] != "submit":
            return
        sub = open_submission(frames[0], run_id=run_id)
        n = sum(len(f) for f in frames)
        size[sub.digest] = n
        if control.get("relay") is True:
            own[sub.digest] += n
            copies[sub.digest] += 1
            by_learner[src].append(sub.digest)
        else:
            relayed[sub.digest] += n

    torch.set_num_threads(1)
    async with MemoryNetwork(
        workdir, nodes=a.nodes, committee_size=a.committee, compression=a.codec
    ) as net:
        run_id, net.hub.tap = net.run_id, tap
        await net.wait_for(lambda: net.min_version() >= a.versions, 600, "the versions")
    # Deltas a learner uploaded at all (a member's own delta goes to its own syncer: no upload).
    uploaded = sorted(own)
    ratio = [own[d] / size[d] for d in uploaded]
    return {
        "nodes": a.nodes,
        "committee": a.committee,
        "codec": a.codec,
        "deltas_uploaded": len(uploaded),
        "payload_bytes_mean": statistics.mean(size[d] for d in uploaded) if uploaded else 0,
        "upload_per_delta_over_payload_mean": statistics.mean(ratio) if ratio else 0.0,
        "upload_per_delta_over_payload_max": max(ratio) if ratio else 0.0,
        "uploads_per_delta_max": max(copies.values()) if copies else 0,
        "relayed_copies_per_delta_mean": statistics.mean(relayed[d] / size[d] for d in size),
        "before_this_change_uploads_per_delta": a.committee,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--committee", type=int, default=4)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="p2pdiloco-uploads-") as d:
        out = asyncio.run(measure(a, Path(d)))
    if a.json:
        print(json.dumps(out, indent=2))
        return
    for k, v in out.items():
        print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}")


if __name__ == "__main__":
    main()
