"""Delta codecs side by side: compression ratio, encode+decode speed vs a memory copy, error.

Every codec and a plain ``clone()`` of the same tensor are timed in one run, interleaved repeat
by repeat (medians of ``--repeats``), so the speed ratio to memcpy cancels out how busy the
machine is (mostly: see below). Encode and decode each allocate their output, as a clone does.

    .venv/bin/python bench/codec.py                         # 16M elements from N(0, 1e-3)
    .venv/bin/python bench/codec.py --numel 4000000 --json  # smaller, machine-readable
    .venv/bin/python bench/codec.py --threads 1             # on a machine shared with others

On an oversubscribed machine every multi-threaded torch op can stall for a scheduler slice
while its sibling thread waits for a core; the blockwise codecs run ~10 ops per 1M-element
chunk and suffer far more from that than one clone() does, so compare with ``--threads 1``.
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

from p2pdiloco.compress import CODECS, get_codec


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=16 * 2**20, help="elements in the delta")
    ap.add_argument("--std", type=float, default=1e-3, help="delta ~ N(0, std)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(a.seed)
    x = torch.randn(a.numel, generator=g) * a.std
    gb = x.numel() * 4 / 1e9
    rows, copy_times = [], []
    for name in CODECS:
        codec = get_codec(name)
        enc = codec.encode(x)
        y = codec.decode(enc)
        t_copy, t_enc, t_dec = [], [], []
        for _ in range(a.repeats):  # interleaved, so a busy spell hits codec and copy alike
            t_copy.append(seconds(x.clone))
            t_enc.append(seconds(lambda c=codec: c.encode(x)))
            t_dec.append(seconds(lambda c=codec, e=enc: c.decode(e)))
        copy_times += t_copy
        t_both = [e + d for e, d in zip(t_enc, t_dec, strict=True)]
        rows.append(
            {
                "codec": name,
                "ratio": x.numel() * 4 / enc.nbytes(),
                "encode_gbps": gb / statistics.median(t_enc),
                "decode_gbps": gb / statistics.median(t_dec),
                "encode_decode_gbps": gb / statistics.median(t_both),
                "vs_memcpy": statistics.median(c / b for c, b in zip(t_copy, t_both, strict=True)),
                "rel_error": float((x - y).norm() / x.norm()),
            }
        )
    out = {
        "command": " ".join(["bench/codec.py", *sys.argv[1:]]),
        "numel": a.numel,
        "std": a.std,
        "threads": torch.get_num_threads(),
        "repeats": a.repeats,
        "memcpy_gbps": gb / statistics.median(copy_times),
        "codecs": rows,
        "seconds": time.perf_counter() - t_start,
        "load_avg_1min": os.getloadavg()[0],  # other jobs on the machine skew the timings
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"delta: {a.numel:,} fp32 from N(0, {a.std:g}) = {gb * 1e3:.0f} MB, "
        f"{out['threads']} threads, median of {a.repeats}; "
        f"memcpy (clone) {out['memcpy_gbps']:.2f} GB/s"
    )
    print(
        f"{'codec':<6} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9} {'enc+dec GB/s':>13} "
        f"{'vs memcpy':>10} {'rel error':>10}"
    )
    for r in rows:
        print(
            f"{r['codec']:<6} {r['ratio']:>6.2f} {r['encode_gbps']:>9.2f} {r['decode_gbps']:>9.2f} "
            f"{r['encode_decode_gbps']:>13.2f} {r['vs_memcpy']:>10.3f} {r['rel_error']:>10.2e}"
        )
    print(
        "GB/s are of fp32 input; vs memcpy = median over repeats of clone time / (encode+decode)"
        f" time, each clone timed just before its encode and decode. {out['seconds']:.0f} s, "
        f"load average {out['load_avg_1min']:.1f} on {os.cpu_count()} CPUs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
