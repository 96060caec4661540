"""What a chaos run's logs say a round costs on these machines, for the simulator's prediction.

Two medians, read from the node logs (``bench/chaos.py`` writes them into its JSON as
``timings``; ``bench/chaos_predict.py`` simulates with them):

- ``merge_s_per_input``: a leader's "proposing K submissions" to its "merged version" line,
  over K (decode, screen, merge, outer step and state hash: the simulator's
  ``merge_seconds_per_input``);
- ``apply_s``: a version's first "certified by" line to each node's "applied version" line
  (the certificate and update reaching the node, the update applied and the state checked:
  the simulator's ``apply_seconds``).

    .venv/bin/python bench/chaos_timings.py bench/out/chaos/chaos-s0.json [--logs DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

_STAMP = "%Y-%m-%d %H:%M:%S,%f"
_PROPOSING = re.compile(r"proposing (\d+) submissions for version (\d+)")
_MERGED = re.compile(r"merged version (\d+):")
_CERTIFIED = re.compile(r"version (\d+) certified by")
_APPLIED = re.compile(r"applied version (\d+)")


def _t(line: str) -> float | None:
    try:
        return datetime.datetime.strptime(line[:23], _STAMP).timestamp()
    except ValueError:
        return None


def timings(texts: Iterable[str]) -> dict[str, float | int | None]:
    """The two medians over the logs ``texts`` (one text per node life), with their counts."""
    merges: list[float] = []
    certified: dict[int, float] = {}
    applied: list[tuple[int, float]] = []
    for text in texts:
        proposed: dict[int, tuple[float, int]] = {}
        for line in text.splitlines():
            if (t := _t(line)) is None:
                continue
            if m := _PROPOSING.search(line):
                proposed[int(m.group(2))] = (t, int(m.group(1)))
            elif (m := _MERGED.search(line)) and int(m.group(1)) in proposed:
                t0, k = proposed.pop(int(m.group(1)))
                merges.append((t - t0) / max(1, k))
            elif m := _CERTIFIED.search(line):
                v = int(m.group(1))
                certified[v] = min(certified.get(v, t), t)
            elif m := _APPLIED.search(line):
                applied.append((int(m.group(1)), t))
    lags = [t - certified[v] for v, t in applied if v in certified and t >= certified[v]]
    return {
        "merge_s_per_input": round(statistics.median(merges), 3) if merges else None,
        "merges": len(merges),
        "apply_s": round(statistics.median(lags), 3) if lags else None,
        "applies": len(lags),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a chaos JSON; its timings are written into it")
    ap.add_argument("--logs", type=Path, help="the run's log folder (default: next to the JSON)")
    a = ap.parse_args()
    logs = a.logs or a.run.with_suffix("")
    texts = [p.read_text(errors="replace") for p in sorted(logs.glob("node*/node*.log"))]
    if not texts:
        print(f"no node logs under {logs}", file=sys.stderr)
        return 2
    run = json.loads(a.run.read_text())
    run["timings"] = timings(texts)
    a.run.write_text(json.dumps(run, indent=2))
    print(f"{a.run.name}: {run['timings']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
