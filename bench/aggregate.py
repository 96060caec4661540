"""Aggregation rules side by side: throughput and time relative to the plain mean.

Every rule (and the screening/clipping defences) runs on the same [M, D] float32 deltas in one
process, interleaved repeat by repeat (medians of ``--repeats``), so the ratio to ``mean``
cancels out how busy the machine is. Throughput is learner-parameters per second (M·D / s).

    .venv/bin/python bench/aggregate.py                          # M=8, D=4M
    .venv/bin/python bench/aggregate.py --weighted --threads 1   # as syncers run: with weights
    .venv/bin/python bench/aggregate.py --learners 16 --numel 1000000 --weighted --json

Every rule keeps its ops within torch's grain (ADR 0023), so ``--threads`` changes only the
mean's last full-length ops and the input validation; on a busy host compare 1-thread figures.

``fold_clones`` is clone folding's pass (ADR 0036), which a merge adds to its rule when the
manifest sets ``rules.clone_factor``: M(M − 1)/2 squared distances, so it grows as M².

Peak memory: after the timings, each rule runs once more while a thread samples the process's
RSS every 2 ms; ``peak_rows`` is what the call added above the inputs, in rows of D float32
(a learner's delta of the fragment: issue 11 bounds a merge at M + 3 of them, so 3 added). The
process re-executes itself with glibc's mmap threshold fixed, so freed buffers leave RSS
(as ``bench/merge_memory.py``, which measures whole merges).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from rss import (  # bench/ is sys.path[0] when a bench runs as a script
    peak_added,
    rerun_with_fixed_mmap,
)

from p2pdiloco.aggregate import clip_norms, get_rule, screen
from p2pdiloco.aggregate.rows import RowSet
from p2pdiloco.sync.clones import fold_clones


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    code = rerun_with_fixed_mmap()  # freed buffers leave RSS: bench/rss.py
    if code is not None:
        return code
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=8, help="M")
    ap.add_argument("--numel", type=int, default=4_000_000, help="D, parameters per delta")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weighted", action="store_true", help="pass token weights to every rule")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: as is)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.learners < 3 or a.numel < 1 or a.repeats < 1 or a.threads < 0:
        ap.error("need --learners >= 3, --numel >= 1, --repeats >= 1, --threads >= 0")
    if a.threads:
        torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    m, d = a.learners, a.numel
    g = torch.Generator().manual_seed(a.seed)
    delta_MD = torch.randn(m, d, generator=g) * torch.rand(m, 1, generator=g).add(0.5)
    weights = torch.randint(1, 10, (m,), generator=g).float() if a.weighted else None
    f = max(0, min(m // 4, (m - 3) // 2))  # tolerate M/4 attackers where Krum allows it
    rules = {
        "mean": get_rule("mean"),
        "median": get_rule("median"),
        f"trimmed_mean(f={f})": get_rule("trimmed_mean", f=f),
        f"krum(f={f})": get_rule("krum", f=f),
        f"multi_krum(f={f})": get_rule("multi_krum", f=f),
        "centered_clip": get_rule("centered_clip"),
        "geometric_median": get_rule("geometric_median"),
    }
    jobs: dict[str, Callable[[], object]] = {
        name: (lambda r=rule: r(delta_MD, weights)) for name, rule in rules.items()
    }
    jobs["screen"] = lambda: screen(delta_MD, expected_numel=d)
    jobs["clip_norms"] = lambda: clip_norms(delta_MD, 1.0)
    every = list(range(m))  # clone folding's distances (ADR 0036), as a merge runs them
    jobs["fold_clones"] = lambda: fold_clones(RowSet([[r] for r in delta_MD]), every, every, 0.25)
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for job in jobs.values():  # warm-up: allocator, first-call dispatch
        job()
    for _ in range(a.repeats):
        for name, job in jobs.items():
            times[name].append(seconds(job))
    med = {k: statistics.median(v) for k, v in times.items()}
    row_bytes = d * 4
    peaks = {name: peak_added(job)[1] / row_bytes for name, job in jobs.items()}
    rows = [
        {
            "rule": k,
            "seconds": med[k],
            "learner_params_per_s": m * d / med[k],
            "time_vs_mean": med[k] / med["mean"],
            "peak_rows": peaks[k],
        }
        for k in jobs
    ]
    out = {
        "command": " ".join(["bench/aggregate.py", *sys.argv[1:]]),
        "learners": m,
        "numel": d,
        "weighted": a.weighted,
        "repeats": a.repeats,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "results": rows,
        "seconds_total": time.perf_counter() - t_start,
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"M={m} D={d:,} float32{' weighted' if a.weighted else ''}, median of {a.repeats}, "
        f"torch {torch.__version__} {out['threads']} threads {out['cpu_capability']}, "
        f"load average {' '.join(f'{x:.2f}' for x in out['load_average'])}"
    )
    print(f"{'rule':<20}{'seconds':>10}{'M·D/s':>12}{'time vs mean':>14}{'peak rows':>11}")
    for r in rows:
        print(
            f"{r['rule']:<20}{r['seconds']:>10.3f}{r['learner_params_per_s'] / 1e6:>11.1f}M"
            f"{r['time_vs_mean']:>13.2f}x{r['peak_rows']:>11.2f}"
        )
    print(f"total {out['seconds_total']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
