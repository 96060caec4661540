"""What ``p2pdiloco demo`` reports once its nodes stopped: the certificate chain verified from
genesis, the final state re-hashed against its certificate, the start and end models evaluated
on the held-out split, and each peer's receipts, refusals (by reason code) and utilization."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pdiloco.errors import UserError
from p2pdiloco.harness.demo_config import DemoConfig, NodeProc
from p2pdiloco.protocol.certificates import Certificate
from p2pdiloco.protocol.reasons import TIMING, Reason
from p2pdiloco.sync.certified import CertifiedState, genesis_state
from p2pdiloco.sync.fetch import verify_next
from p2pdiloco.train.checkpoint import CheckpointStore
from p2pdiloco.train.data import build_corpus, eval_batches
from p2pdiloco.train.inner import evaluate
from p2pdiloco.train.models import build_for_loading, get_spec, param_state
from p2pdiloco.train.tokenizer import load_tokenizer


@dataclass
class DemoResult:
    versions: int
    loss_start: float
    loss_end: float
    seconds: float
    run_id: str
    committee: dict[int, list[str]]
    peers: dict[str, dict[str, Any]]
    rejected: dict[str, int]
    downloads: list[dict[str, Any]] = field(default_factory=list)
    workdir: str = ""
    fragments: int = 1  # version v synced fragment (v − 1) mod fragments

    def to_dict(self) -> dict[str, Any]:
        return {
            "versions": self.versions,
            "loss_start": self.loss_start,
            "loss_end": self.loss_end,
            "seconds": round(self.seconds, 1),
            "run_id": self.run_id,
            "committee": {str(k): v for k, v in self.committee.items()},
            "fragments": self.fragments,
            "peers": self.peers,
            "rejected": self.rejected,
            "workdir": self.workdir,
        }


def summarize(
    cfg: DemoConfig,
    nodes: list[NodeProc],
    statuses: list[dict[str, Any]],
    manifest: Any,
    run_id: str,
    workdir: Path,
    t0: float,
) -> DemoResult:
    names = {n.identity.peer_id: n.name for n in nodes}
    # The certificate chain from genesis, verified exactly as a late joiner would.
    certs_dir = nodes[0].dir / "state" / "certs"
    chain: list[Certificate] = []
    prev: Certificate | None = None
    for path in sorted(certs_dir.glob("*.json")):
        prev = verify_next(run_id, manifest, prev, path.read_bytes())
        chain.append(prev)
    if not chain:
        raise UserError("no certified version was produced")
    final = chain[-1]
    ckpt = CheckpointStore(nodes[0].dir / "state" / "certified").load_latest(verify=True)
    if ckpt is None:
        raise UserError("node0 saved no certified state")
    state = CertifiedState.from_tensors(final.body.version, final, ckpt.tensors)
    if not state.matches(final):
        raise UserError("node0's saved state does not match the final certificate")

    spec = get_spec(cfg.model)
    corpus = build_corpus("embedded", load_tokenizer(spec.tokenizer), seq_len=cfg.seq_len)
    evals = eval_batches(corpus, batch_size=cfg.batch_size, max_batches=cfg.eval_batches)
    model = build_for_loading(cfg.model)
    start = genesis_state(manifest)
    _load(model, start)
    loss_start = evaluate(model, evals)
    _load(model, state)
    loss_end = evaluate(model, evals)

    accepted, rejected, tokens = Counter[str](), Counter[str](), Counter[str]()
    for c in chain:
        for a in c.body.accepted:
            accepted[a.peer_id] += a.credited
            tokens[a.peer_id] += a.tokens
        for r in c.body.rejected:
            rejected[r.peer_id] += 1
    # Submissions refused before aggregation as bad input (forged, replayed, stale, malformed,
    # ...), once per submission and round. A delta that only came late (its round had closed,
    # or one syncer had moved on) is not a rejection: that is timing, not a verdict. Screened-out
    # deltas are already counted from the certificates.
    screened = {r.digest for c in chain for r in c.body.rejected}
    refused: set[tuple[str, str, Any]] = set()
    codes: dict[str, Counter[str]] = {n.identity.peer_id: Counter() for n in nodes}
    for c in chain:
        for r in c.body.rejected:
            codes.setdefault(r.peer_id, Counter())[Reason.SCREENED_OUT.value] += 1
    for s in statuses:
        for r in s.get("rejections", []):
            digest, code = r.get("digest"), Reason.parse(r.get("code"))
            if digest in screened or code in TIMING:
                continue
            key = (r.get("peer_id", ""), digest or r.get("reason", ""), r.get("round"))
            if key not in refused:
                codes.setdefault(key[0], Counter())[code.value] += 1
            refused.add(key)
    for peer, _, _ in refused:
        rejected[peer] += 1
    by_peer = {s.get("peer_id"): s for s in statuses}

    def figure(peer: str, key: str) -> float:  # from its status file (issue 10)
        return float(by_peer.get(peer, {}).get(key) or 0.0)

    peers = {
        n.name: {
            "peer_id": n.identity.peer_id,
            "adversary": n.adversary,
            "accepted": accepted[n.identity.peer_id],
            "rejected": rejected[n.identity.peer_id],
            "refusals": dict(codes[n.identity.peer_id]),  # reason code → count, of "rejected"
            "tokens": tokens[n.identity.peer_id],
            # share of wall time in inner steps; the time in them; send → certificate waits
            "utilization": figure(n.identity.peer_id, "utilization"),
            "train_seconds": figure(n.identity.peer_id, "train_seconds"),
            "sync_wait_s": figure(n.identity.peer_id, "sync_wait_s"),
        }
        for n in nodes
    }
    return DemoResult(
        versions=final.body.version,
        loss_start=loss_start,
        loss_end=loss_end,
        seconds=time.monotonic() - t0,
        run_id=run_id,
        committee={c.body.version: [names.get(m, m) for m in c.body.committee] for c in chain},
        peers=peers,
        rejected={n.name: rejected[n.identity.peer_id] for n in nodes},
        workdir=str(workdir) if cfg.workdir else "",
        fragments=manifest.outer.fragments,
    )


def _load(model: Any, state: CertifiedState) -> None:
    import torch

    with torch.no_grad():
        for n, p in param_state(model).items():
            p.copy_(state.params[n])
