"""Issue 14's Sybil flood against real processes: fresh identities cannot poison, shut out or sit.

Three honest nodes (the genesis committee, k = q = 3) train until they have earned trust on the
certified roster (``trust_min_accepted`` = ``trust_min_age`` = 2 here, so it takes three
versions); then five fresh identities send every syncer poisoned deltas (±0.05 per entry, about
a hundred times an honest delta's norm) with the largest claim a header may make, for every
version until the honest nodes reach version 8.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from p2pdiloco.compress import get_codec
from p2pdiloco.compress.wire import pack_deltas
from p2pdiloco.demo import LocalNetwork
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
from p2pdiloco.sync.trust import probation_room
from p2pdiloco.train.models import build_model, param_state
from tests.netutil import wait_for
from tests.test_sync_network import SMALL, certificates

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FLOOD_FROM, UNTIL = 3, 9


def test_a_flood_of_fresh_identities_neither_poisons_nor_shuts_out_nor_sits(
    tmp_path: Path,
) -> None:
    with LocalNetwork(tmp_path, SMALL) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(3)]
        run_id = net.publish_run(keys, trust_min_accepted=2, trust_min_age=2)
        nodes = [net.start_node(f"node{i}", k, until_version=UNTIL + 1) for i, k in enumerate(keys)]
        m = net.manifest
        codec = get_codec(m.compression)
        shapes = param_state(build_model(m.model, seed=0))
        gen = torch.Generator().manual_seed(1)
        sybils = []
        for _ in range(5):
            poison = {
                n: 0.05 * torch.randn(t.shape, generator=gen).sign() for n, t in shapes.items()
            }
            payload = pack_deltas({n: codec.encode(poison[n]) for n in sorted(poison)})
            sybils.append((Identity.generate(), payload))
        steps = 10**9  # clipped to H, tokens scaled alike: the largest weight a header can get
        tokens = steps * m.inner.batch_size * m.inner.seq_len

        replies: list[dict] = []
        sent_for: set[int] = set()
        attacker = Identity.generate()
        with DHTPlane(attacker, initial_peers=[net.boot_addr], host="127.0.0.1") as dht:
            bridge = P2PBridge(dht.dht)
            try:
                view = wait_for(
                    "every node's heartbeat",
                    lambda: (
                        (v := read_peers(dht, run_id))
                        and all(k.peer_id in v.peers for k in keys)
                        and v
                    ),
                    120,
                )
                targets = {k.peer_id: list(view.peers[k.peer_id].heartbeat.addrs) for k in keys}
                net.wait_versions(FLOOD_FROM, nodes, 300)
                loss_before = max(float(n.status()["last_loss"]) for n in nodes)
                pause = threading.Event()
                while min(int(n.status().get("version", 0)) for n in nodes) < UNTIL:
                    base = min(int(n.status().get("version", 0)) for n in nodes)
                    for ident, payload in sybils if base not in sent_for else []:
                        header = SubmissionHeader(
                            peer_id=ident.peer_id, base_version=base, steps=steps,
                            tokens=tokens, loss=1.0, codec=m.compression,
                            fragments=[FragmentRef(index=0, digest=payload_digest(payload),
                                                   nbytes=len(payload))],
                        )  # fmt: skip
                        raw = seal_submission(ident, run_id, header)
                        for target, addrs in targets.items():
                            try:
                                reply, _ = bridge.run(
                                    call(bridge.p2p, target, "submit", frames=[raw, payload],
                                         addrs=addrs), 60,
                                )  # fmt: skip
                            except RpcError as e:
                                reply = {"status": "refused", "reason": str(e)}
                            replies.append(reply)
                    sent_for.add(base)
                    assert all(n.proc.poll() is None for n in nodes), nodes[0].log_tail()
                    pause.wait(0.5)  # polls the nodes' status files, not a synchronisation
            finally:
                bridge.close()
        statuses = net.wait_versions(UNTIL, nodes, 300)

    honest = {k.peer_id for k in keys}
    fresh = {ident.peer_id for ident, _ in sybils}
    certs = certificates(nodes[0], run_id)
    assert [c.body.version for c in certs][-1] >= UNTIL
    assert any(r.get("status") == "accepted" for r in replies), replies[:5]  # it was exercised
    for c in certs:
        assert not fresh & set(c.body.committee), f"a fresh identity sat on v{c.body.version}"
    flooded = [c for c in certs if c.body.version > FLOOD_FROM + 1]  # rounds on base ≥ 4
    assert len(flooded) >= UNTIL - FLOOD_FROM - 1
    for c in flooded:
        merged = [a.peer_id for a in c.body.accepted]
        n_honest = sum(p in honest for p in merged)
        assert n_honest >= 2, f"v{c.body.version} merged {merged}"  # the quorum is trusted work
        assert sum(p in fresh for p in merged) <= probation_room(n_honest, 0.25)
        assert not fresh & set(merged), f"v{c.body.version} merged a poisoned delta"
    for peer in honest:  # nobody shut out
        assert sum(peer in {a.peer_id for a in c.body.accepted} for c in flooded) >= 2
    loss_after = max(float(s["last_loss"]) for s in statuses)
    assert loss_after < loss_before, (loss_before, loss_after)  # the attack raised it 10×
