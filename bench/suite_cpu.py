"""CPU time of a command and of every process it starts, by kind of process (ADR 0024).

    .venv/bin/python bench/suite_cpu.py -- .venv/bin/python -m pytest -q -n 2 --dist worksteal

Samples ``/proc`` every half second while the command runs and keeps the latest user + system
time of each of its descendants, so a process that lives less than a sample, or the part of one after the
last sample, is missed (a few per cent). Linux only. Kinds come from the parent chain and the
command line: the test workers, the zygotes (tests/zygote.py) and the commands they fork
(nodes and bootstraps), hivemind's DHT processes, gossip children (spawned, or forked from the
tests' gossip zygote), p2pd daemons, fresh ``python -m p2pdiloco`` commands.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[str, str, float, str]:
    """(comm, parent pid, CPU seconds, start time) of one process."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    f = raw[raw.rindex(")") + 2 :].split()
    return comm, f[1], (int(f[11]) + int(f[12])) / HZ, f[19]


def _kind(pid: str, comm: str, parent: str) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        cmd = ""
    if comm == "p2pd" or cmd.split(" ")[0].endswith("p2pd"):
        return "p2pd daemons"
    if "torch_shm" in comm:
        return "torch_shm_manager"
    if "p2pdiloco-gossip-zygote" in cmd:  # tests/gossip_zygote.py and what it forks
        return "gossip children (forked)" if parent == "gossip zygotes" else "gossip zygotes"
    if "multiprocessing.spawn" in cmd:
        return "gossip children (spawned interpreters)"
    if "import atexit, json" in cmd:  # the zygote's program, inherited by what it forks
        return {
            "test workers": "zygotes",
            "zygotes": "nodes and bootstraps (forked from a zygote)",
            "nodes and bootstraps (forked from a zygote)": "hivemind DHT processes",
        }.get(parent, "other zygote descendants")
    if "-m p2pdiloco" in cmd:
        return "fresh p2pdiloco commands"
    if parent == "command" and "python" in cmd:
        return "test workers"
    return f"other ({comm})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to run")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    proc = subprocess.Popen(cmd)
    seen: dict[tuple[str, str], tuple[float, str]] = {}  # (pid, start): (CPU s, kind)
    kinds = {str(proc.pid): "command"}
    t0 = time.monotonic()
    while proc.poll() is None:
        for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
            if pid in before:
                continue
            try:
                comm, parent, cpu, start = _stat(pid)
            except (OSError, ValueError, IndexError):
                continue  # gone between listing and reading
            if pid != str(proc.pid) and parent not in kinds:
                continue  # not (yet known as) a descendant of the command
            key = (pid, start)
            if key in seen:
                kind = seen[key][1]
            elif pid == str(proc.pid):
                kind = "the command itself"
            else:
                kind = _kind(pid, comm, kinds.get(parent, "?"))
            kinds[pid] = "command" if pid == str(proc.pid) else kind
            seen[key] = (cpu, kind)
        time.sleep(0.5)
    wall = time.monotonic() - t0
    cpu_by, count = Counter[str](), Counter[str]()
    for cpu, kind in seen.values():
        cpu_by[kind] += cpu
        count[kind] += 1
    for kind, cpu in cpu_by.most_common():
        print(f"{cpu:9.1f} CPU-s  {count[kind]:5d} processes  {kind}")
    total = sum(cpu_by.values())
    print(f"{total:9.1f} CPU-s in all, {wall:.0f} s of wall time ({total / wall:.2f} cores busy)")
    raise SystemExit(proc.returncode)


if __name__ == "__main__":
    main()
