"""Peak memory of one syncer merge: the windowed ``merge_round`` beside a stacked merge.

A fresh process builds M deltas of a fragment (``--tensors`` × ``--numel`` float32), then merges
them while a thread samples its RSS; what the merge adds above what was held before (the
deltas, the certified state) is printed in fragments. ``--stacked`` measures the algorithm the
syncer used before windows (one [M, D] stack, the rule on it, the outer step), for comparison.
glibc's mmap threshold is fixed so freed fragments leave RSS (see ``main``).

    .venv/bin/python bench/merge_memory.py                        # M=8, 12 × 2 M, trimmed_mean
    .venv/bin/python bench/merge_memory.py --rule median --stacked
    .venv/bin/python bench/merge_memory.py --update-codec int8   # as sync.certified.next_state
"""

from __future__ import annotations

import argparse
import json
import sys

from rss import (  # bench/ is sys.path[0] when a bench runs as a script
    peak_added,
    rerun_with_fixed_mmap,
)


def _measure(a: argparse.Namespace) -> dict:
    import torch

    from p2pdiloco.aggregate import get_rule
    from p2pdiloco.protocol.records import SyncRules
    from p2pdiloco.sync.aggregator import MergeInput, merge_round
    from p2pdiloco.testing.outer import OuterOptimizer
    from p2pdiloco.train.outer import OuterConfig

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = {f"t{k:02d}": (a.numel,) for k in range(a.tensors)}
    params = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    momentum = {n: torch.zeros(s) for n, s in shapes.items()}
    inputs = [
        MergeInput(
            f"{i:02d}",
            f"p{i}",
            {n: torch.randn(s, generator=g) * 1e-2 for n, s in shapes.items()},
            1.0 + i,
        )
        for i in range(a.learners)
    ]
    rules = SyncRules(aggregation=a.rule, aggregation_params=json.loads(a.params))

    def stacked(ins: list[MergeInput]) -> int:
        names = sorted(params)
        delta_MD = torch.stack([torch.cat([i.delta[n].reshape(-1) for n in names]) for i in ins])
        rule = get_rule(rules.aggregation, **rules.aggregation_params)
        merged_D = rule(delta_MD, [i.weight for i in ins])
        new = {n: params[n].clone() for n in names}
        opt = OuterOptimizer(OuterConfig())
        opt.momentum = {n: momentum[n].clone() for n in names}
        opt.step(new, dict(zip(names, merged_D.split([a.numel] * a.tensors), strict=True)))
        return len(ins)

    def windowed(ins: list[MergeInput]) -> int:
        if a.update_codec is None:
            out = merge_round(params, momentum, ins, rules=rules, outer=OuterConfig())
            return len(out.accepted)
        from p2pdiloco.sync.update import pack_update, update_codec

        codec = update_codec(a.update_codec)  # and the pack a syncer serves (ADR 0029)
        out = merge_round(
            params, momentum, ins, rules=rules, outer=OuterConfig(), update_codec=codec
        )
        raw = pack_update(out.update)
        return len(out.accepted) if raw else 0

    merge = stacked if a.stacked else windowed
    merge(inputs)  # warm-up: first-call allocations are not the merge's (freed ones leave RSS)
    kept, extra = peak_added(lambda: merge(inputs))
    frag = a.tensors * a.numel * 4
    return {
        "command": " ".join(["bench/merge_memory.py", *sys.argv[1:]]),
        "merge": "stacked" if a.stacked else "windowed",
        "rule": a.rule,
        "update_codec": a.update_codec,
        "learners": a.learners,
        "fragment_mb": frag / 2**20,
        "kept": kept,
        "added_mb": extra / 2**20,
        "added_fragments": extra / frag,
        "bound_fragments": 3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=8, help="M")
    ap.add_argument("--tensors", type=int, default=12)
    ap.add_argument("--numel", type=int, default=2_000_000, help="float32 values per tensor")
    ap.add_argument("--rule", default="trimmed_mean")
    ap.add_argument("--params", default='{"f": 2}', help="rule parameters as JSON")
    ap.add_argument("--stacked", action="store_true", help="the pre-window algorithm")
    ap.add_argument("--update-codec", help="also encode and pack the certified update")
    a = ap.parse_args()
    code = rerun_with_fixed_mmap()  # each fragment-sized tensor its own mapping: bench/rss.py
    if code is not None:
        return code
    print(json.dumps(_measure(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
