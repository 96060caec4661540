"""How well a work score tells honest work from free riding, at the Byzantine cell's stretch.

Runs ``bench/byzantine.py``'s clean median cell with work scoring (8 learners, H = 5, batch 4,
seq 32, lr 3e-3: 20 own rows a delta) and, at every merge, records the per-row losses at the
certified parameters θ and at θ − Δ for every learner's delta, on every learner's own rows and
on 256 other rows, plus the same for deltas a free rider could send: the last certified update
(scaled to the median honest norm: a replay) and noise of that norm. A copy of learner j's
delta sent by learner i is learner j's delta scored on i's rows. Then for each credit rule it
prints the share of each kind that would be credited (advantage > 0):

    ADR 0062   min(own drop, own drop − the drop on rows not assigned to the sender)
    paired k   min(own drop, own drop − the mean drop of k other deltas on the same own rows)
    matched k  the same, each reference scaled to the scored delta's norm (ADR 0065)

(ADR 0065). The references are drawn at random per delta (seeded), ``--draws`` times.

    did k      (own drop − drop on rows not assigned) − the same of k other deltas (ADR 0066)

It also scores **stale honest work** (ADR 0066): every learner's delta of the round before, on
the rows it trained then, at this round's θ, as a learner that rebased mid-stretch sends it:
the paired score refuses most of it, the difference in differences does not (and pays riders).
``--save`` / ``--load`` keep the recorded losses to try further rules on them.

    .venv/bin/python bench/scoring_power.py --seeds 0,1,2 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

import byzantine  # noqa: E402  (the cell's settings)

import p2pdiloco.harness.simulate as simulate  # noqa: E402
from p2pdiloco.sync import scoring  # noqa: E402


@torch.no_grad()
def row_losses(model: torch.nn.Module, rows_NS: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of each row [N]."""
    out = []
    for chunk in torch.split(rows_NS, 32):
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits.float()
        out.append(F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none").mean(1))
    return torch.cat(out)


def record(seed: int, rounds: int) -> list[dict[str, Any]]:
    """One cell's merges: per merge, the losses of every candidate on every row set."""
    records: list[dict[str, Any]] = []
    scorers: list[scoring.WorkScorer] = []
    init = scoring.WorkScorer.__init__

    def keep(self: scoring.WorkScorer, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        scorers.append(self)

    merge = simulate.merge_fragment
    prev: list[Any] = []

    def observed(theta: Any, momentum: Any, deltas: Any, tokens: Any, names: Any, **kw: Any) -> Any:
        work, last = kw.get("work"), kw.get("last_update")
        if scorers and work is not None:
            s, v, m = scorers[-1], work.seed, len(deltas)
            own = [s.rows_of(simulate.learner_id(i), v)[0] for i in range(m)]
            g = torch.Generator().manual_seed(1000 + v)
            other = torch.randperm(int(s.train_NS.shape[0]), generator=g)[:256]
            rows = s.train_NS[torch.cat([*own, other])]

            def norm(d: Any) -> torch.Tensor:
                return torch.sqrt(sum((d[n].double() ** 2).sum() for n in names))

            size = torch.stack([norm(d) for d in deltas]).median()
            cands = {f"d{i}": deltas[i] for i in range(m)}
            if last and all(n in last for n in names):
                cands["replay"] = {n: (last[n] * (size / norm(last))).float() for n in names}
            noise = {n: torch.randn(deltas[0][n].shape, generator=g) for n in names}
            cands["noise"] = {n: (noise[n] * (size / norm(noise))).float() for n in names}
            rec: dict[str, Any] = {"m": m, "sizes": [len(o) for o in own]}
            s._load(theta, None)
            rec["base"] = row_losses(s.model, rows)
            for k, d in cands.items():
                s._load(theta, d)
                rec[k] = row_losses(s.model, rows)
            # References scaled to the scored delta's norm (ADR 0065): learner j's delta at
            # learner i's norm on i's rows, and at the median norm (a rider's) on every own row.
            norms = [norm(d) for d in deltas]
            rec["matched"] = {}
            for i in range(m):
                for j in range(m):
                    if j != i:
                        s._load(theta, deltas[j], float(norms[i] / norms[j]))
                        rec["matched"][(i, j)] = row_losses(s.model, s.train_NS[own[i]])
            rec["at_median"] = {}
            for j in range(m):
                s._load(theta, deltas[j], float(size / norms[j]))
                rec["at_median"][j] = row_losses(s.model, s.train_NS[torch.cat(own)])
            # Stale honest work (ADR 0066): each learner's delta of the round before, on the
            # rows it trained then, scored at this round's θ (a stretch that a round's close
            # overtook), with this round's deltas as references on the same rows.
            if prev:
                pdeltas, pown = prev[-1]
                st: dict[int, dict[str, Any]] = {}
                for i in range(min(m, len(pdeltas))):
                    rows_i = s.train_NS[pown[i]]
                    s._load(theta, None)
                    e = {"base": row_losses(s.model, rows_i)}
                    s._load(theta, pdeltas[i])
                    e["own"] = row_losses(s.model, rows_i)
                    e["other"] = row_losses(s.model, s.train_NS[other])
                    e["refs"] = {}
                    for j in range(m):
                        s._load(theta, deltas[j])
                        e["refs"][j] = row_losses(s.model, rows_i)
                    st[i] = e
                rec["stale"] = st
            prev.append(([{n: d[n].clone() for n in names} for d in deltas], own))
            records.append(rec)
        return merge(theta, momentum, deltas, tokens, names, **kw)

    scoring.WorkScorer.__init__ = keep  # type: ignore[method-assign]
    simulate.merge_fragment = observed  # type: ignore[assignment]
    try:
        a = argparse.Namespace(
            learners=8,
            inner_steps=5,
            rounds=rounds,
            data="embedded",
            seed=seed,
            eval_batches=4,
            compression="none",
            work=True,
            batch_size=4,
            seq_len=32,
            lr=3e-3,
        )
        byzantine.run_cell(a, ("median", {}), None, 0, 0.25)
    finally:
        scoring.WorkScorer.__init__ = init  # type: ignore[method-assign]
        simulate.merge_fragment = merge
    return records


def split(rec: dict[str, Any], key: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    x, out, at = rec[key], [], 0
    for size in rec["sizes"]:
        out.append(x[at : at + size])
        at += size
    return out, x[at:]


def advantage(
    rec: dict[str, Any], i: int, key: str, refs: list[int] | None, matched: bool = False
) -> float:
    """The advantage of candidate ``key`` sent by learner ``i``: against rows not assigned
    (``refs`` None, ADR 0062) or against the deltas ``refs`` on i's own rows (ADR 0065),
    ``matched``: each scaled to the candidate's norm (i's own delta's, or the median's for a
    rider's replay or noise)."""
    base_own, base_other = split(rec, "base")
    own_after, other_after = split(rec, key)
    own = float((base_own[i] - own_after[i]).mean())
    if refs is None:
        return min(own, own - float((base_other - other_after).mean()))

    def after(j: int) -> torch.Tensor:
        if not matched:
            return split(rec, f"d{j}")[0][i]
        if key == f"d{i}":
            return rec["matched"][(i, j)]
        at = sum(rec["sizes"][:i])
        return rec["at_median"][j][at : at + rec["sizes"][i]]

    other = sum(float((base_own[i] - after(j)).mean()) for j in refs) / len(refs)
    return min(own, own - other)


def did(rec: dict[str, Any], i: int, key: str, refs: list[int]) -> float:
    """ADR 0066's difference in differences: candidate ``key``'s drop on learner i's own rows
    minus its drop on rows not assigned, less the same difference of the deltas ``refs``
    (unscaled): staleness and a delta's size move both row sets alike and cancel, and so does
    how easy i's rows are to improve."""
    base_own, base_other = split(rec, "base")

    def gap(k: str) -> float:
        own_after, other_after = split(rec, k)
        own = float((base_own[i] - own_after[i]).mean())
        return own - float((base_other - other_after).mean())

    return gap(key) - sum(gap(f"d{j}") for j in refs) / len(refs)


def stale_rates(records: list[dict[str, Any]], k: int) -> dict[str, float]:
    """Credit rates of stale honest deltas (the round before's, on their rows) per rule."""
    rng = random.Random(1)
    out: dict[str, list[bool]] = {}
    for rec in records:
        other_base = split(rec, "base")[1]
        for i, e in rec.get("stale", {}).items():
            own = float((e["base"] - e["own"]).mean())
            gap = own - float((other_base - e["other"]).mean())
            refs = rng.sample([j for j in range(rec["m"]) if j != i], k)
            ref_own = [float((e["base"] - e["refs"][j]).mean()) for j in refs]
            paired = min(own, own - sum(ref_own) / k)
            out.setdefault("ADR 0062 (other rows)", []).append(min(own, gap) > 0)
            out.setdefault(f"paired, {k} (unscaled)", []).append(paired > 0)
            # The references' own-minus-other gap on i's rows of the round before is not
            # recorded on rows not assigned; their own drop there stands for it, less their
            # drop on the other rows (recorded in this round's "d{j}").
            ref_gap = [
                r - float((other_base - split(rec, f"d{j}")[1]).mean())
                for r, j in zip(ref_own, refs, strict=True)
            ]
            out.setdefault(f"did, {k}", []).append(gap - sum(ref_gap) / k > 0)
    return {rule: sum(v) / len(v) for rule, v in out.items()}


def did_rates(records: list[dict[str, Any]], k: int, draws: int) -> dict[str, float]:
    rng = random.Random(0)
    passed: dict[str, list[bool]] = {}
    for _ in range(draws):
        for rec in records:
            m = rec["m"]
            for i in range(m):
                pool = [j for j in range(m) if j != i]
                for kind, key in [("honest", f"d{i}")] + [
                    (kind, kind) for kind in ("replay", "noise") if kind in rec
                ]:
                    refs = rng.sample(pool, min(k, len(pool)))
                    passed.setdefault(kind, []).append(did(rec, i, key, refs) > 0)
                for j in pool:
                    refs = rng.sample([r for r in pool if r != j], min(k, len(pool) - 1))
                    passed.setdefault("copy", []).append(did(rec, i, f"d{j}", refs) > 0)
    return {kind: sum(v) / len(v) for kind, v in passed.items()}


def rates(
    records: list[dict[str, Any]], k: int | None, draws: int, matched: bool = False
) -> dict[str, float]:
    """Credit rates per kind; with ``matched``, copies are left out (their references would
    be scaled to the copied delta's norm, not recorded)."""
    rng = random.Random(0)
    passed: dict[str, list[bool]] = {}
    for _ in range(draws if k is not None else 1):
        for rec in records:
            m = rec["m"]
            for i in range(m):
                for kind, key in [("honest", f"d{i}")] + [
                    (kind, kind) for kind in ("replay", "noise") if kind in rec
                ]:
                    pool = [j for j in range(m) if j != i]
                    refs = rng.sample(pool, min(k, len(pool))) if k is not None else None
                    passed.setdefault(kind, []).append(advantage(rec, i, key, refs, matched) > 0)
                for j in range(m if not matched else 0):  # learner j's delta sent by i
                    if j != i:
                        pool = [r for r in range(m) if r not in (i, j)]
                        refs = rng.sample(pool, min(k, len(pool))) if k is not None else None
                        passed.setdefault("copy", []).append(advantage(rec, i, f"d{j}", refs) > 0)
    return {kind: sum(v) / len(v) for kind, v in passed.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--refs", default="1,2,3,4,7", help="reference counts of the paired rule")
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", help="write the recorded losses here (torch.save)")
    ap.add_argument("--load", help="read recorded losses instead of running the cell")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if args.load:
        records = torch.load(args.load, weights_only=False)
    else:
        records = [r for s in args.seeds.split(",") for r in record(int(s), args.rounds)]
    if args.save:
        torch.save(records, args.save)
    honest = sum(r["m"] for r in records)
    rows: dict[str, dict[str, float]] = {"ADR 0062 (other rows)": rates(records, None, 1)}
    for k in (int(x) for x in args.refs.split(",")):
        rows[f"paired, {k} reference(s)"] = rates(records, k, args.draws)
    for k in (int(x) for x in args.refs.split(",")):
        rows[f"norm-matched, {k}"] = rates(records, k, args.draws, matched=True)
    for k in (int(x) for x in args.refs.split(",")):
        rows[f"did, {k}"] = did_rates(records, k, args.draws)
    stale = stale_rates(records, 2)
    if args.json:
        json.dump({"honest_deltas": honest, "rates": rows}, sys.stdout, indent=1)
        return 0
    print(f"{honest} honest deltas, seeds {args.seeds}, {time.perf_counter() - t0:.0f} s")
    print(f"{'rule':26} {'honest':>7} {'copy':>7} {'noise':>7} {'replay':>7}")
    for name, r in rows.items():
        print(
            f"{name:26} "
            + " ".join(
                f"{r.get(k, float('nan')):7.3f}" for k in ("honest", "copy", "noise", "replay")
            )
        )
    print("stale honest deltas (the round before's, scored at this round's θ):")
    for rule, rate in stale.items():
        print(f"  {rule:26} {rate:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
