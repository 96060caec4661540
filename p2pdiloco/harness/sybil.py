"""A Sybil flood against a local network, for the test and the benchmark of issue 14.

Fresh identities (no history on the certified roster) send every syncer a poisoned delta
(±``scale`` per entry: about a hundred times an honest delta's norm at 0.05) with the largest
claim a header may make, once for every certified version from ``start`` until the nodes reach
``until``. They speak the real sync protocol from one DHT client of this process, as any peer
could; the nodes are real processes (``p2pdiloco.harness.demo.LocalNetwork``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from p2pdiloco.compress import get_codec
from p2pdiloco.compress.wire import pack_deltas
from p2pdiloco.errors import UserError
from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import NodeProc
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.net.discovery import read_peers
from p2pdiloco.net.p2p_bridge import P2PBridge
from p2pdiloco.net.sync_rpc import RpcError, call
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.submissions import (
    FragmentRef,
    SubmissionHeader,
    payload_digest,
    seal_submission,
)
from p2pdiloco.train.models import build_model, param_state


@dataclass
class FloodReport:
    sybils: list[str]  # their peer ids
    replies: list[dict[str, Any]] = field(default_factory=list)
    loss_before: float = 0.0  # the honest nodes' last training loss when the flood started
    first_base: int = 0  # the first base version the flood sent for
    until: int = 0  # the version every node held when it stopped

    @property
    def accepted(self) -> int:
        return sum(r.get("status") == "accepted" for r in self.replies)


async def submit(
    bridge: P2PBridge, target: str, addrs: list[str], frames: list[bytes]
) -> dict[str, Any]:
    try:
        reply, _ = await call(bridge.p2p, target, "submit", frames=frames, addrs=addrs, timeout=60)
    except RpcError as e:
        return {"status": "refused", "reason": str(e)}
    return reply


async def gather_replies(sends: list[Coroutine[Any, Any, dict[str, Any]]]) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*sends))


def _versions(nodes: list[NodeProc]) -> int:
    return min(int(n.status().get("version", 0)) for n in nodes)


def flood(
    net: LocalNetwork,
    run_id: str,
    nodes: list[NodeProc],
    *,
    count: int = 5,
    start: int = 3,
    until: int = 9,
    scale: float = 0.05,
    only: str | None = None,
    rounds: int | None = None,
    timeout: float = 600.0,
) -> FloodReport:
    """Flood from certified version ``start`` until every node holds ``until`` (or, with
    ``rounds``, that many versions past the first one flooded). ``only``: send to that one
    node instead of every syncer (scale 0: zero deltas, valid in every way)."""
    m = net.manifest
    assert m is not None and net.boot_addr, "start the bootstrap and publish the run first"
    codec = get_codec(m.compression)
    gen = torch.Generator().manual_seed(1)
    shapes = param_state(build_model(m.model, seed=0))
    sybils = []
    for _ in range(count):
        poison = {n: scale * torch.randn(t.shape, generator=gen).sign() for n, t in shapes.items()}
        sybils.append(
            (Identity.generate(), pack_deltas({n: codec.encode(poison[n]) for n in sorted(poison)}))
        )
    steps = 10**9  # clipped to H, tokens scaled alike: the largest weight a header can get
    tokens = steps * m.inner.batch_size * m.inner.seq_len
    report = FloodReport([s.peer_id for s, _ in sybils])
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    with DHTPlane(Identity.generate(), initial_peers=[net.boot_addr], host="127.0.0.1") as dht:
        bridge = P2PBridge(dht.dht)
        try:
            want = {n.identity.peer_id for n in nodes}
            while not want <= set((view := read_peers(dht, run_id)).peers):
                if time.monotonic() > deadline:
                    raise UserError("the flood never saw every node's heartbeat")
                pause.wait(0.5)
            targets = {
                p: list(view.peers[p].heartbeat.addrs) for p in sorted(want) if only in (None, p)
            }
            net.wait_versions(start, nodes, max(1.0, deadline - time.monotonic()))
            report.loss_before = max(float(n.status().get("last_loss") or 0.0) for n in nodes)
            sent_for: set[int] = set()
            report.first_base = _versions(nodes)
            if rounds is not None:  # the nodes may have moved past ``start`` meanwhile
                until = report.first_base + rounds
            report.until = until
            while (base := _versions(nodes)) < until:
                if time.monotonic() > deadline:
                    raise UserError(f"the nodes did not reach version {until} during the flood")
                if base not in sent_for:  # every copy at once: a round closes in a second
                    sends = []
                    for ident, payload in sybils:
                        ref = FragmentRef(
                            index=0, digest=payload_digest(payload), nbytes=len(payload)
                        )
                        header = SubmissionHeader(
                            peer_id=ident.peer_id,
                            base_version=base,
                            steps=steps,
                            tokens=tokens,
                            loss=1.0,
                            codec=m.compression,
                            fragments=[ref],
                        )
                        raw = seal_submission(ident, run_id, header)
                        sends += [
                            submit(bridge, target, addrs, [raw, payload])
                            for target, addrs in targets.items()
                        ]
                    report.replies += bridge.run(gather_replies(sends), 120)
                sent_for.add(base)
                for n in nodes:
                    if n.proc.poll() is not None:
                        raise UserError(f"{n.name} exited during the flood:\n{n.log_tail()}")
                pause.wait(0.5)  # polls the nodes' status files
        finally:
            bridge.close()
    return report
