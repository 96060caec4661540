"""Credit rates of candidate work-score rules over losses ``bench/scoring_power.py`` saved.

    .venv/bin/python bench/scoring_power.py --seeds 0,1 --rounds 6 --refs 2 --draws 1 --save rec.pt
    .venv/bin/python bench/scoring_rules.py rec.pt

Per kind (honest, copy, noise, replay, stale honest: ADR 0066) the share credited by: the
paired score (ADR 0065, references unscaled here), ADR 0062's, the difference in differences
(own drop − drop on other rows, less the same of 2 references) with and without
min(own drop, ·), and unions, at several margins. One seeded draw of references.
"""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from scoring_power import split  # noqa: E402

# (own drop, own − other rows, references' mean own drop, references' mean own − other rows)
Parts = tuple[float, float, float, float]
Rule = Callable[[float, float, float, float], bool]


def mean(x: torch.Tensor) -> float:
    return float(x.mean())


def parts(records: list[dict[str, Any]]) -> dict[str, list[Parts]]:
    rng = random.Random(0)
    out: dict[str, list[Parts]] = {k: [] for k in ("honest", "copy", "noise", "replay", "stale")}
    for rec in records:
        m = rec["m"]
        base_own, base_other = split(rec, "base")

        def other_drop(key: str, rec: dict[str, Any] = rec) -> float:
            return mean(split(rec, "base")[1] - split(rec, key)[1])

        def on_own(i: int, key: str, rec: dict[str, Any] = rec) -> float:
            return mean(split(rec, "base")[0][i] - split(rec, key)[0][i])

        od = {j: other_drop(f"d{j}") for j in range(m)}
        for i in range(m):
            pool = [j for j in range(m) if j != i]
            refs = rng.sample(pool, 2)
            ref_own = [on_own(i, f"d{j}") for j in refs]
            ref_gap = sum(o - od[j] for o, j in zip(ref_own, refs, strict=True)) / 2
            at, size = sum(rec["sizes"][:i]), rec["sizes"][i]
            matched = [mean(base_own[i] - rec["matched"][(i, j)]) for j in refs]
            own = on_own(i, f"d{i}")
            out["honest"].append((own, own - od[i], sum(matched) / 2, ref_gap))
            for kind in ("replay", "noise"):
                if kind in rec:
                    own = on_own(i, kind)
                    scaled = [mean(base_own[i] - rec["at_median"][j][at : at + size]) for j in refs]
                    out[kind].append((own, own - other_drop(kind), sum(scaled) / 2, ref_gap))
            for j in pool:  # learner j's delta sent by i
                rr = [r for r in pool if r != j][:2]
                own, oj = on_own(i, f"d{j}"), [on_own(i, f"d{r}") for r in rr]
                gap = sum(o - od[r] for o, r in zip(oj, rr, strict=True)) / 2
                out["copy"].append((own, own - od[j], sum(oj) / 2, gap))
        for i, e in rec.get("stale", {}).items():
            own = mean(e["base"] - e["own"])
            refs = rng.sample([j for j in range(m) if j != i], 2)
            oj = [mean(e["base"] - e["refs"][j]) for j in refs]
            gap = sum(o - od[j] for o, j in zip(oj, refs, strict=True)) / 2
            out["stale"].append((own, own - mean(base_other - e["other"]), sum(oj) / 2, gap))
    return out


def rules() -> dict[str, Rule]:
    def paired(o: float, g: float, pr: float, gr: float) -> bool:
        return min(o, o - pr) > 0

    def adr0062(o: float, g: float, pr: float, gr: float) -> bool:
        return min(o, g) > 0

    out: dict[str, Rule] = {"paired (ADR 0065)": paired, "ADR 0062": adr0062}
    for margin in (0.0, 0.01, 0.02, 0.03, 0.05):

        def did(o: float, g: float, pr: float, gr: float, mg: float = margin) -> bool:
            return g - gr > mg

        def did_min(o: float, g: float, pr: float, gr: float, mg: float = margin) -> bool:
            return min(o, g - gr) > mg

        def either(o: float, g: float, pr: float, gr: float, mg: float = margin) -> bool:
            return paired(o, g, pr, gr) or did(o, g, pr, gr, mg)

        out[f"did > {margin}"] = did
        out[f"min(own, did) > {margin}"] = did_min
        out[f"paired or did > {margin}"] = either
    return out


def main() -> int:
    comps = parts(torch.load(sys.argv[1], weights_only=False))
    print("deltas:", {k: len(v) for k, v in comps.items()})
    print(f"{'rule':26}" + "".join(f"{k:>8}" for k in comps))
    for name, rule in rules().items():
        rates = [sum(rule(*c) for c in v) / len(v) if v else float("nan") for v in comps.values()]
        print(f"{name:26}" + "".join(f"{r:8.3f}" for r in rates))
    for kind, v in comps.items():
        if v:
            did = statistics.median(g - gr for _, g, _, gr in v)
            print(f"{kind}: median difference in differences {did:+.4f} nats")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
