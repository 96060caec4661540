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

sys.path.insert(0, str(Path(__file__).parent))

import byzantine  # noqa: E402  (the cell's settings)

import p2pdiloco.harness.simulate as simulate  # noqa: E402
from p2pdiloco.sync import scoring  # noqa: E402
from p2pdiloco.sync.scoring import gap_z  # noqa: E402  (the statistic the merge applies)
from p2pdiloco.train.inner import row_losses as inner_row_losses  # noqa: E402


def row_losses(model: torch.nn.Module, rows_NS: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of each row [N], as the z test reads it (``train.inner``)."""
    return inner_row_losses(model, list(torch.split(rows_NS, 32)))


def record(
    seed: int,
    rounds: int,
    *,
    inner_steps: int = 5,
    batch_size: int = 4,
    seq_len: int = 32,
    lr: float = 3e-3,
    lean: bool = False,
    learners: int = 8,
    max_own: int | None = None,
) -> list[dict[str, Any]]:
    """One cell's merges: per merge, the losses of every candidate on every row set. ``lean``
    records only what the row-count tables need (every delta, the replay and noise on every
    row set, and the stale deltas on their own and the other rows), not the references."""
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
            if max_own is not None:
                pick = torch.Generator().manual_seed(2000 + v)
                own = [o[torch.randperm(len(o), generator=pick)[:max_own]] for o in own]
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

            def stale_losses(pdelta: Any, pown_i: torch.Tensor) -> dict[str, Any]:
                """A delta of the round before at this θ, on its rows then and the other rows."""
                rows_i = s.train_NS[pown_i]
                s._load(theta, None)
                e = {"base": row_losses(s.model, rows_i)}
                s._load(theta, pdelta)
                e["own"] = row_losses(s.model, rows_i)
                e["other"] = row_losses(s.model, s.train_NS[other])
                return e

            if lean:
                if prev:
                    pdeltas, pown = prev[-1][:2]
                    rec["stale"] = {}
                    for i in range(min(m, len(pdeltas))):
                        e = stale_losses(pdeltas[i], pown[i])
                        if "replay" in cands:  # a rider that names rows trained and credited
                            s._load(theta, cands["replay"])
                            e["replay"] = row_losses(s.model, s.train_NS[pown[i]])
                        rec["stale"][i] = e
                prev.append(([{n: d[n].clone() for n in names} for d in deltas], own))
                records.append(rec)
                return merge(theta, momentum, deltas, tokens, names, **kw)
            # References scaled to the scored delta's norm (ADR 0065): learner j's delta at
            # learner i's norm on i's rows, and at the median norm (a rider's) on every own row.
            norms = [norm(d) for d in deltas]
            rec["matched"] = {}
            for i in range(m):
                for j in range(m):
                    if j != i:
                        s._load(theta, deltas[j], float(norms[i] / norms[j]))
                        rec["matched"][(i, j)] = row_losses(s.model, s.train_NS[own[i]])
            if last and all(n in last for n in names):  # the update at each delta's norm
                rec["update_matched"] = {}
                for i in range(m):
                    s._load(theta, last, float(norms[i] / norm(last)))
                    rec["update_matched"][i] = row_losses(s.model, s.train_NS[own[i]])
            rec["at_median"] = {}
            for j in range(m):
                s._load(theta, deltas[j], float(size / norms[j]))
                rec["at_median"][j] = row_losses(s.model, s.train_NS[torch.cat(own)])
            # Stale honest work (ADR 0066): each learner's delta of the round before, on the
            # rows it trained then, scored at this round's θ (a stretch that a round's close
            # overtook), with this round's deltas as references on the same rows.
            if prev:
                pdeltas, pown = prev[-1][:2]
                st: dict[int, dict[str, Any]] = {}
                for i in range(min(m, len(pdeltas))):
                    rows_i = s.train_NS[pown[i]]
                    e = stale_losses(pdeltas[i], pown[i])
                    e["refs"] = {}
                    for j in range(m):
                        s._load(theta, deltas[j])
                        e["refs"][j] = row_losses(s.model, rows_i)
                    # References as stale as it: the round before's other deltas, at its norm
                    # and at the median norm (a rider's), and the last update replayed at the
                    # median norm, all here at this round's θ on its rows (ADR 0068).
                    pn, psize = prev[-1][4], prev[-1][3]
                    e["stale_refs"], e["stale_refs_median"] = {}, {}
                    for j in range(len(pdeltas)):
                        if j != i:
                            s._load(theta, pdeltas[j], float(pn[i] / pn[j]))
                            e["stale_refs"][j] = row_losses(s.model, rows_i)
                            s._load(theta, pdeltas[j], float(psize / pn[j]))
                            e["stale_refs_median"][j] = row_losses(s.model, rows_i)
                    if last and all(n in last for n in names):
                        s._load(theta, last, float(psize / norm(last)))
                        e["replay"] = row_losses(s.model, rows_i)
                        s._load(theta, last, float(pn[i] / norm(last)))
                        e["update_ref"] = row_losses(s.model, rows_i)  # at its norm
                    st[i] = e
                rec["stale"] = st
            # A rider's best case if deltas were scored at the θ their stretch began (ADR 0068):
            # this round's public update, replayed at the round before's θ (where it is exactly
            # the run's next step), at that round's median norm, on that round's own rows.
            if prev and last and all(n in last for n in names):
                ptheta, psize, pown, pnorms = prev[-1][2], prev[-1][3], prev[-1][1], prev[-1][4]
                upd = {n: last[n].float() for n in names}
                s._load(ptheta, upd, float(psize / norm(last)))
                rec["replay_at_start"] = row_losses(s.model, s.train_NS[torch.cat(pown)])
                # The update as a reference: scaled to each delta's norm, on its rows.
                rec["update_at_start"] = {}
                for i, rows_i in enumerate(pown):
                    s._load(ptheta, upd, float(pnorms[i] / norm(last)))
                    rec["update_at_start"][i] = row_losses(s.model, s.train_NS[rows_i])
                # A rider that hides the replay under noise, just below the replay screen
                # (cosine 0.9 < max_cosine 0.95), at the median norm.
                c = 0.9
                unit_u = {n: upd[n] / norm(upd) for n in names}
                unit_z = {n: noise[n] / norm(noise) for n in names}
                mix = {n: (c * unit_u[n] + (1 - c * c) ** 0.5 * unit_z[n]) * psize for n in names}
                s._load(ptheta, mix)
                rec["mix_at_start"] = row_losses(s.model, s.train_NS[torch.cat(pown)])
            prev.append(
                (
                    [{n: d[n].clone() for n in names} for d in deltas],
                    own,
                    {n: theta[n].detach().clone() for n in theta},
                    size,
                    norms,
                )
            )
            records.append(rec)
        return merge(theta, momentum, deltas, tokens, names, **kw)

    scoring.WorkScorer.__init__ = keep  # type: ignore[method-assign]
    simulate.merge_fragment = observed  # type: ignore[assignment]
    try:
        a = argparse.Namespace(
            learners=learners,
            inner_steps=inner_steps,
            rounds=rounds,
            data="embedded",
            seed=seed,
            eval_batches=4,
            compression="none",
            work=True,
            batch_size=batch_size,
            seq_len=seq_len,
            lr=lr,
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


def at_start_rates(records: list[dict[str, Any]], k: int, draws: int) -> dict[str, float]:
    """Credit rates if a delta were scored at the θ its stretch began, against references of
    the same age (ADR 0068): honest work of round v−1 at θ_{v−1} (its delta, stale or not, is
    scored where it trained: the round's own honest rate, recomputed here on the same pairs)
    and the public update of round v replayed there, each against k deltas of round v−1 scaled
    to its norm, on the sender's rows of round v−1."""
    rng = random.Random(2)
    passed: dict[str, list[bool]] = {}
    for before, rec in zip(records, records[1:], strict=False):
        if "replay_at_start" not in rec or before["m"] != len(before["sizes"]):
            continue
        base_own = split(before, "base")[0]
        m, at = before["m"], 0
        for i in range(m):
            size_i = before["sizes"][i]
            replay = rec["replay_at_start"][at : at + size_i]
            mix = rec["mix_at_start"][at : at + size_i]
            upd_i = float((base_own[i] - rec["update_at_start"][i]).mean())
            for _ in range(draws):
                refs = rng.sample([j for j in range(m) if j != i], k)
                ref_drop = (
                    sum(
                        float((base_own[i] - before["at_median"][j][at : at + size_i]).mean())
                        for j in refs
                    )
                    / k
                )
                honest = advantage(before, i, f"d{i}", refs, matched=True)
                own = float((base_own[i] - split(before, f"d{i}")[0][i]).mean())
                rider = float((base_own[i] - replay).mean())
                hidden = float((base_own[i] - mix).mean())
                # The riders' update reference is the update at their norm: the replay itself.
                passed.setdefault("honest", []).append(honest > 0)
                passed.setdefault("replay", []).append(min(rider, rider - ref_drop) > 0)
                passed.setdefault("replay + noise, cos 0.9", []).append(
                    min(hidden, hidden - ref_drop) > 0
                )
                passed.setdefault("honest, update a reference", []).append(
                    min(honest, own - upd_i) > 0
                )
                passed.setdefault("replay, update a reference", []).append(
                    min(rider, rider - ref_drop, rider - rider) > 0
                )
                passed.setdefault("replay + noise, update a ref.", []).append(
                    min(hidden, hidden - ref_drop, hidden - rider) > 0
                )
            at += size_i
    return {kind: sum(v) / len(v) for kind, v in passed.items()}


def update_ref_rates(records: list[dict[str, Any]], k: int, draws: int) -> dict[str, float]:
    """Fresh honest deltas at this round's θ with the last update (scaled to their norm) as one
    more reference beside k others (ADR 0068); a replay ties with it and is never credited."""
    rng = random.Random(4)
    passed: list[bool] = []
    for rec in records:
        if "update_matched" not in rec:
            continue
        base_own = split(rec, "base")[0]
        for i in range(rec["m"]):
            own = float((base_own[i] - split(rec, f"d{i}")[0][i]).mean())
            u = float((base_own[i] - rec["update_matched"][i]).mean())
            for _ in range(draws):
                refs = rng.sample([j for j in range(rec["m"]) if j != i], k)
                passed.append(min(advantage(rec, i, f"d{i}", refs, matched=True), own - u) > 0)
    return {"honest, update a ref.": sum(passed) / max(1, len(passed))}


def same_age_rates(records: list[dict[str, Any]], k: int, draws: int) -> dict[str, float]:
    """Credit rates at this round's θ when the references are as stale as the scored delta
    (ADR 0068): a delta of the round before on its rows against k other deltas of the round
    before (scaled to its norm), and a rider naming those rows with the last update replayed
    (at the median norm) against the same references at its norm."""
    rng = random.Random(3)
    passed: dict[str, list[bool]] = {}
    for rec in records:
        for e in rec.get("stale", {}).values():
            pool = sorted(e.get("stale_refs", {}))
            if len(pool) < k:
                continue
            for _ in range(draws):
                refs = rng.sample(pool, k)
                own = float((e["base"] - e["own"]).mean())
                ref = sum(float((e["base"] - e["stale_refs"][j]).mean()) for j in refs) / k
                passed.setdefault("stale honest", []).append(min(own, own - ref) > 0)
                if "update_ref" in e:
                    u = float((e["base"] - e["update_ref"]).mean())
                    passed.setdefault("stale honest, update a ref.", []).append(
                        min(own, own - ref, own - u) > 0
                    )
                if "replay" in e:
                    r = float((e["base"] - e["replay"]).mean())
                    rm = sum(float((e["base"] - e["stale_refs_median"][j]).mean()) for j in refs)
                    passed.setdefault("replay", []).append(min(r, r - rm / k) > 0)
    return {kind: sum(v) / len(v) for kind, v in passed.items()}


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


def row_count_rates(
    records: list[dict[str, Any]], counts: list[int | None], zs: list[float]
) -> dict[str, dict[str, float]]:
    """Credit rates of the within-delta z test per kind, when the committee scores n own rows
    and n rows not assigned (``None``: every own row and all 256 other rows recorded), at each
    threshold z, with and without ``own drop > 0``. Rows are drawn seeded per delta."""
    out: dict[str, dict[str, list[bool]]] = {}
    g = torch.Generator().manual_seed(7)
    for rec in records:
        m = rec["m"]
        base_other = split(rec, "base")[1]

        def drops(key: str, i: int, rec: dict[str, Any] = rec) -> tuple[torch.Tensor, ...]:
            own_after, other_after = split(rec, key)
            return split(rec, "base")[0][i] - own_after[i], split(rec, "base")[1] - other_after

        cands: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for i in range(m):
            cands.append(("honest", *drops(f"d{i}", i)))
            cands.append(("copy", *drops(f"d{(i + 1) % m}", i)))
            for kind in ("replay", "noise"):
                if kind in rec:
                    cands.append((kind, *drops(kind, i)))
        for e in rec.get("stale", {}).values():
            other = base_other - e["other"]
            cands.append(("stale honest", e["base"] - e["own"], other))
            if "replay" in e:  # its own credited rows, replayed inside the update
                cands.append(
                    ("replay, own credited rows", e["base"] - e["replay"], split(rec, "replay")[1])
                )
        for kind, own, other in cands:
            for n in counts:
                pick_o = torch.randperm(own.numel(), generator=g)[: n or own.numel()]
                pick_x = torch.randperm(other.numel(), generator=g)[: n or other.numel()]
                o, x = own[pick_o], other[pick_x]
                z = gap_z(o, x)
                label = f"{n or 'all'}"
                for zc in zs:
                    d = out.setdefault(f"{label} rows, z>{zc:g}", {})
                    d.setdefault(kind, []).append(z > zc)
                    d2 = out.setdefault(f"{label} rows, z>{zc:g}, own>0", {})
                    d2.setdefault(kind, []).append(z > zc and float(o.mean()) > 0)
                out.setdefault(f"{label} rows, median z", {}).setdefault(kind, []).append(z)
    res: dict[str, dict[str, float]] = {}
    for rule, kinds in out.items():
        if rule.endswith("median z"):
            res[rule] = {
                k: float(torch.tensor(v, dtype=torch.float64).median()) for k, v in kinds.items()
            }
        else:
            res[rule] = {k: sum(v) / len(v) for k, v in kinds.items()}
    return res


def by_round_rates(
    records: list[dict[str, Any]], rounds: int, n: int, z: float, draws: int = 20
) -> dict[tuple[int, str], float]:
    """Share credited by the z test (``n`` own and ``n`` other rows, z > ``z``) per round of
    the cell (records hold ``rounds`` merges per seed, in order) and kind, over ``draws``
    seeded draws of rows per delta: how the test's power grows as a run leaves its start."""
    g = torch.Generator().manual_seed(5)
    out: dict[tuple[int, str], list[bool]] = {}
    for k, rec in enumerate(records):
        r, m = k % rounds + 1, rec["m"]
        base_own, base_other = split(rec, "base")
        cands: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for i in range(m):
            for kind, key in (
                ("fresh honest", f"d{i}"),
                ("copy", f"d{(i + 1) % m}"),
                ("replay", "replay"),
            ):
                if key in rec:
                    own_after, other_after = split(rec, key)
                    cands.append((kind, base_own[i] - own_after[i], base_other - other_after))
        for e in rec.get("stale", {}).values():
            cands.append(("stale honest", e["base"] - e["own"], base_other - e["other"]))
        for kind, own, other in cands:
            for _ in range(draws):
                po = torch.randperm(own.numel(), generator=g)[:n]
                px = torch.randperm(other.numel(), generator=g)[:n]
                out.setdefault((r, kind), []).append(gap_z(own[po], other[px]) > z)
    return {key: sum(v) / len(v) for key, v in sorted(out.items())}


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
    ap.add_argument("--inner-steps", type=int, default=5, help="H of the cell")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument(
        "--lean",
        action="store_true",
        help="record only what the row-count table needs and print only it",
    )
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--max-own", type=int, help="own rows recorded per learner (default all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--row-counts", default="20,64,128,256,all", help="own rows scored")
    ap.add_argument("--z", default="2.33,3.09", help="thresholds of the z test")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.load:
        records = torch.load(args.load, weights_only=False)
    else:
        cell = {
            "inner_steps": args.inner_steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "lean": args.lean,
            "learners": args.learners,
            "max_own": args.max_own,
        }
        records = [r for s in args.seeds.split(",") for r in record(int(s), args.rounds, **cell)]
    if args.save:
        torch.save(records, args.save)
    honest = sum(r["m"] for r in records)
    counts = [None if c == "all" else int(c) for c in args.row_counts.split(",")]
    by_count = row_count_rates(records, counts, [float(z) for z in args.z.split(",")])
    kinds = ("honest", "stale honest", "copy", "noise", "replay", "replay, own credited rows")
    if args.load:
        print(f"losses loaded from {args.load} (the cell's flags are those it was recorded with)")
    print(
        f"{honest} honest deltas, seeds {args.seeds}, H {args.inner_steps} × batch "
        f"{args.batch_size} = {args.inner_steps * args.batch_size} own rows "
        f"({records[0]['sizes'][0]} recorded), {args.learners} learners, seq {args.seq_len}, lr "
        f"{args.lr:g}, {time.perf_counter() - t0:.0f} s"
    )
    print("within-delta z test (own rows' drops against rows not assigned, Welch):")
    print(f"  {'rule':24} " + " ".join(f"{k[:12]:>12}" for k in kinds))
    for rule, r in by_count.items():
        print(f"  {rule:24} " + " ".join(f"{r.get(k, float('nan')):12.3f}" for k in kinds))
    n_round, z_round = 128, 3.0
    table = by_round_rates(records, args.rounds, n_round, z_round)
    print(f"by round, {n_round} rows a side, z > {z_round:g}, 20 draws of rows per delta:")
    kinds_r = ("fresh honest", "stale honest", "copy", "replay")
    print(f"  {'round':>5} " + " ".join(f"{k:>13}" for k in kinds_r))
    for r in range(1, args.rounds + 1):
        cells = [table.get((r, k)) for k in kinds_r]
        print(
            f"  {r:5d} " + " ".join(f"{c:13.3f}" if c is not None else f"{'-':>13}" for c in cells)
        )
    if args.lean:
        return 0
    rows: dict[str, dict[str, float]] = {"ADR 0062 (other rows)": rates(records, None, 1)}
    for k in (int(x) for x in args.refs.split(",")):
        rows[f"paired, {k} reference(s)"] = rates(records, k, args.draws)
    for k in (int(x) for x in args.refs.split(",")):
        rows[f"norm-matched, {k}"] = rates(records, k, args.draws, matched=True)
    for k in (int(x) for x in args.refs.split(",")):
        rows[f"did, {k}"] = did_rates(records, k, args.draws)
    stale = stale_rates(records, 2)
    at_start = at_start_rates(records, 2, args.draws)
    same_age = same_age_rates(records, 2, args.draws)
    same_age.update(update_ref_rates(records, 2, args.draws))
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
    print("scored at the θ the stretch began, 2 same-age references at matched norm (ADR 0068):")
    for kind, rate in at_start.items():
        print(f"  {kind:26} {rate:7.3f}")
    print("at this round's θ, 2 references as old as the delta, matched norm (ADR 0068):")
    for kind, rate in same_age.items():
        print(f"  {kind:26} {rate:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
