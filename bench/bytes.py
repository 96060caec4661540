"""Bytes per learner per round on a real local network, against bf16 data-parallel.

A bootstrap and ``--nodes`` ``join`` processes train gemma-tiny on loopback (``LocalNetwork``,
the demo's network). Every node counts the sync protocol's frames it sends and receives
(``net.sync_rpc.TRAFFIC``: submissions, proposals, signatures, state downloads; not the DHT,
gossip or libp2p framing) and reports them in its status file. Between the first certified
version and ``--versions``, each node's upload and download are divided by the versions it
applied, times the fragments F (a round of H steps syncs each fragment once: F versions); the
table gives the mean over nodes. Every node is a learner, and the committee (k of them) is
drawn from them, so a node's total includes its turns as a syncer and serving peers. The
learner's own part is counted apart (``learner_bytes_up``: its deltas as uploaded, once per
delta since ADR 0028; ``learner_bytes_down``: the certified updates and states it downloaded
to follow the run). A learner moves those only for versions whose committee it is not on (a
member takes its own delta and makes the state itself), so ``off-comm`` divides them by those
versions: what a volunteer who never sits on a committee moves per round.

Data-parallel reference at equal tokens: a bf16 ring all-reduce of the P parameters sends and
receives 2 × (N − 1) / N × 2 × P bytes per learner per step, H steps per round; the total of
both directions is twice that, against a volunteer's up + down.

Each ``--update-codec`` is a run of its own (per delta codec): a dense one certifies the merged
pseudo-gradient (``--update-form gradient``, ADR 0029) unless ``--update-form params`` says
otherwise; a sparse one (topk2, ``--update-k`` entries per 4096) certifies the parameters' change
with the committee's error feedback (ADR 0064). Each run's eval loss at version ``--versions``
(node0's saved certified parameters, the demo's eval batches) is reported beside its bytes, with
its ratio to the first update codec's run of the same delta codec: equal rounds, equal tokens.

    .venv/bin/python bench/bytes.py                              # int8, H = 20, 4 nodes
    .venv/bin/python bench/bytes.py --codec int8 --codec topk2 --inner-steps 20 --json
    .venv/bin/python bench/bytes.py --nodes 6 --committee-size 3 --fragments 4   # ADR 0032
    .venv/bin/python bench/bytes.py --nodes 6 --committee-size 3 --versions 3 --codec topk2 \
        --update-codec int8 --update-codec topk2                 # sparse updates, ADR 0064
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2pdiloco.choices import SPARSE_CODECS
from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import DemoConfig
from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.protocol.identity import Identity


def param_count(model: str) -> int:
    from p2pdiloco.train.models import build_model, param_state

    return sum(t.numel() for t in param_state(build_model(model, seed=0)).values())


def measure(a: argparse.Namespace, codec: str, update: str, workdir: Path) -> dict[str, Any]:
    form = "params" if update in SPARSE_CODECS else a.update_form
    cfg = DemoConfig(
        nodes=a.nodes,
        inner_steps=a.inner_steps,
        compression=codec,
        batch_size=4,
        seq_len=64,
        grace=30.0,
        agree_timeout=10.0,
        committee_size=min(a.committee_size, a.nodes),
        fragments=a.fragments,
        update_compression=update,
        aggregation=a.aggregation or DemoConfig.aggregation,
    )
    rules: dict[str, Any] = {"update_form": form}
    if update in SPARSE_CODECS and a.update_k is not None:
        rules["update_k"] = a.update_k
    t0 = time.monotonic()
    with LocalNetwork(workdir, cfg) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(a.nodes)]
        net.publish_run(keys, **rules)
        nodes = [
            net.start_node(f"node{i}", k, until_version=a.versions + 1) for i, k in enumerate(keys)
        ]
        first = net.wait_versions(1, nodes, a.timeout)
        last = net.wait_versions(a.versions, nodes, a.timeout)
        committees = {
            c.body.version: set(c.body.committee)
            for c in (
                parse_certificate(p.read_bytes(), run_id=net.run_id)
                for p in (nodes[0].dir / "state" / "certs").glob("*.json")
            )
        }
    per: dict[str, list[float]] = {k: [] for k in KEYS}
    off_up: list[float] = []
    off_down: list[float] = []
    for node, s0, s1 in zip(nodes, first, last, strict=True):
        v0, v1 = int(s0["version"]), int(s1["version"])
        rounds = max(1, v1 - v0) / a.fragments
        for key, field in KEYS.items():
            per[key].append((s1.get(field, 0) - s0.get(field, 0)) / rounds)
        # A learner uploads and downloads only for versions whose committee it is not on (a
        # member takes its own delta and makes the state itself): per such version, × F.
        off = sum(
            node.identity.peer_id not in committees.get(v, set()) for v in range(v0 + 1, v1 + 1)
        )
        if off:
            off_up.append((s1["learner_bytes_up"] - s0["learner_bytes_up"]) / off * a.fragments)
            off_down.append(
                (s1["learner_bytes_down"] - s0["learner_bytes_down"]) / off * a.fragments
            )
    up = statistics.mean(off_up) if off_up else 0.0
    down = statistics.mean(off_down) if off_down else 0.0
    return {
        "codec": codec,
        "update_codec": update,
        "update_form": form,
        **{k: statistics.mean(v) for k, v in per.items()},
        "off_committee_up": up,
        "off_committee_down": down,
        "off_committee_total": up + down,
        "off_committee_learners": len(off_up),
        "eval_loss": eval_loss(cfg, net.run_id, nodes[0].dir / "state", a.versions),
        "seconds": time.monotonic() - t0,
    }


def eval_loss(cfg: DemoConfig, run_id: str, state_dir: Path, version: int) -> float:
    """Eval loss of the certified parameters of ``version`` that ``state_dir`` saved (checked
    against its certificate), on the demo's eval batches."""
    import torch

    from p2pdiloco.sync.certified import CertifiedState
    from p2pdiloco.train.checkpoint import CheckpointStore, load_checkpoint
    from p2pdiloco.train.data import build_corpus, eval_batches
    from p2pdiloco.train.inner import evaluate
    from p2pdiloco.train.models import build_for_loading, get_spec, param_state
    from p2pdiloco.train.tokenizer import load_tokenizer

    cert = parse_certificate(
        (state_dir / "certs" / f"{version:08d}.json").read_bytes(), run_id=run_id
    )
    path = CheckpointStore(state_dir / "certified").path_for(version)
    state = CertifiedState.from_tensors(version, cert, load_checkpoint(path).tensors)
    if not state.matches(cert):
        raise SystemExit(f"the saved state of version {version} is not the certified one")
    spec = get_spec(cfg.model)
    corpus = build_corpus("embedded", load_tokenizer(spec.tokenizer), seq_len=cfg.seq_len)
    rows = eval_batches(corpus, batch_size=cfg.batch_size, max_batches=cfg.eval_batches)
    model = build_for_loading(cfg.model)
    with torch.no_grad():
        for n, p in param_state(model).items():
            p.copy_(state.params[n])
    return float(evaluate(model, rows))


# Row key → status.json field (runtime.status).
KEYS = {
    "up": "bytes_up",
    "down": "bytes_down",
    "learner_up": "learner_bytes_up",
    "learner_down": "learner_bytes_down",
}
RATIOS = [*KEYS, "off_committee_up", "off_committee_down"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=20, help="H")
    ap.add_argument("--versions", type=int, default=4, help="certified versions to reach")
    ap.add_argument("--codec", action="append", help="repeatable; default int8")
    ap.add_argument("--model", default="gemma-tiny")
    ap.add_argument("--committee-size", type=int, default=4, help="k")
    ap.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo fragments F")
    ap.add_argument(
        "--update-codec", action="append", help="the certified update's codec; repeatable"
    )
    ap.add_argument(
        "--update-form",
        default="gradient",
        choices=["gradient", "params"],
        help="what a dense update codec certifies (a sparse one: params)",
    )
    ap.add_argument("--update-k", type=int, help="entries per 4096 of a topk2 update")
    ap.add_argument("--aggregation", help=f"merge rule [default: {DemoConfig.aggregation}]")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.nodes < 2 or a.versions < 2 or a.inner_steps < 1:
        ap.error("need --nodes >= 2, --versions >= 2, --inner-steps >= 1")
    if a.fragments < 1 or a.inner_steps % a.fragments:
        ap.error("--inner-steps must be a multiple of --fragments")
    codecs = a.codec or ["int8"]
    updates = a.update_codec or ["int8"]
    p = param_count(a.model)
    n = a.nodes
    dp = 2 * (n - 1) / n * 2 * p * a.inner_steps  # bf16 ring all-reduce, one way, per round
    rows = []
    for codec in codecs:
        for update in updates:
            with tempfile.TemporaryDirectory(prefix="p2pdiloco-bytes-") as tmp:
                r = measure(a, codec, update, Path(tmp))
            r["dp_one_way"] = dp
            for key in RATIOS:
                r[f"{key}_vs_dp"] = dp / r[key] if r[key] else None
                r[f"{key}_bytes_per_param"] = r[key] / p
            total = r["off_committee_total"]
            r["off_committee_total_vs_dp"] = 2 * dp / total if total else None
            ref = next(x for x in [*rows, r] if x["codec"] == codec)
            r["loss_vs_first_update_codec"] = r["eval_loss"] / ref["eval_loss"]
            rows.append(r)
    out = {
        "command": " ".join(["bench/bytes.py", *sys.argv[1:]]),
        "model": a.model,
        "params": p,
        "nodes": n,
        "inner_steps": a.inner_steps,
        "committee_size": min(a.committee_size, n),
        "fragments": a.fragments,
        "aggregation": a.aggregation or DemoConfig.aggregation,
        "update_codecs": updates,
        "update_form": a.update_form,
        "update_k": a.update_k,
        "loss_version": a.versions,
        "rows": rows,
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{a.model} ({p:,} parameters), {n} nodes, k = {min(a.committee_size, n)}, "
        f"H = {a.inner_steps}, F = {a.fragments}; per node per round of H steps"
    )
    print(f"bf16 data-parallel ring all-reduce: {dp / 1e6:.2f} MB each way")
    print(
        f"{'codec':8} {'update':14} {'':8} {'up MB':>9} {'down MB':>9} {'DP/up':>8} "
        f"{'DP/down':>8} {'DP/total':>8}"
    )
    for r in rows:
        update = f"{r['update_codec']} ({r['update_form']})"
        for label, (up, down) in (
            ("off-comm", ("off_committee_up", "off_committee_down")),
            ("learner", ("learner_up", "learner_down")),
            ("all", ("up", "down")),
        ):
            both = 2 * dp / (r[up] + r[down]) if r[up] + r[down] else None
            print(
                f"{r['codec']:8} {update:14} {label:8} {r[up] / 1e6:9.3f} {r[down] / 1e6:9.3f} "
                f"{_ratio(r[up + '_vs_dp']):>8} {_ratio(r[down + '_vs_dp']):>8} "
                f"{_ratio(both):>8}"
            )
        print(
            f"{'':8} {'':14} eval loss at version {a.versions}: {r['eval_loss']:.4f} "
            f"({r['loss_vs_first_update_codec']:.4f} × the first update codec's)"
        )
    return 0


def _ratio(x: float | None) -> str:
    return f"{x:.0f}x" if x is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
