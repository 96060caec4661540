"""Soak on real processes: a run lives through ordinary life for ``--minutes`` (default 20).

A bootstrap and 3-6 volunteers, each a real ``p2pdiloco bootstrap`` / ``p2pdiloco join``
process on loopback (``p2pdiloco.harness.demo.LocalNetwork``, as the demo starts them: its own
key, DHT daemon and gossip host), train gemma-tiny with the demo's small settings. Once every
volunteer applied version 1, ordinary life begins (seeded): every ``--every`` seconds a random
volunteer that is up is either stopped with Ctrl-C (SIGINT to its process group, as a terminal
sends it; it must stop cleanly) or SIGKILLed (a crash or power loss), and ``--down`` seconds
later it rejoins with the same key and state directory; the bootstrap is stopped with Ctrl-C
once, in the middle half, and restarted with the same key and port; and one volunteer is
starved of CPU for the whole soak (its process group SIGSTOPped for ``--starve-duty`` of every
``--starve-period`` seconds, as an overloaded machine would leave it). A volunteer that exits
on its own is started again after ``--supervisor-delay`` s (a systemd unit's Restart=). After
the soak the nodes get ``--settle`` s to agree, are stopped, and every state directory is
verified against its certificates.

It reports, with the definitions of ``bench/chaos_verify.py`` unless said here:

- **versions certified** during the soak, and the **longest gap** between two certificates;
- **stalls beyond the view bound**: gaps longer than one view that fails and the next at the
  pacemaker's backed-off timeout (twice view 0's, at most ``view_timeout_max``: ADR 0055, issue
  39 item 2): one departure may cost one view, never more;
- **lost versions**: a certified version no node holds verified at the end, a fork, a node whose
  final chain is shorter than what it applied, or a node whose state went backwards (a status
  file, in one life or across a rejoin, at a version below one it had reported);
- **corrupt states**: any saved state or certificate that does not verify;
- **tracebacks** in any log (volunteers and bootstrap), and crashes (exits nobody asked for,
  other than ``join``'s one-line refusals, exit code 2);
- each Ctrl-C: whether the volunteer stopped cleanly, and how long it took.

    .venv/bin/python -m bench.soak                      # 4 volunteers, 20 minutes, seed 0
    .venv/bin/python -m bench.soak --minutes 3 --volunteers 3 --json

Run it alone on a small machine (``flock /tmp/heavy.lock ...``): the volunteers share the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.chaos import FOREVER, Life, Watch, kill_group, restart_bootstrap, settle
from bench.chaos_verify import (
    BOOTSTRAP,
    certified_times,
    gaps,
    lost_versions,
    report_dict,
    stall_allowance,
    verify_state_dir,
)
from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.harness.demo_config import DemoConfig, NodeProc
from p2pdiloco.net.lifeline import descendants
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest

SIGINT, SIGKILL, RESTART = "sigint", "sigkill", "restart"


@dataclass(frozen=True)
class Fault:
    t: float  # seconds after the soak began
    target: str  # a volunteer's name, or "bootstrap"
    action: str  # "sigint" (Ctrl-C), "sigkill", or "restart" (same key, state dir, port)


def make_plan(
    seed: int,
    seconds: float,
    names: Sequence[str],
    every: tuple[float, float],
    down: tuple[float, float],
) -> list[Fault]:
    """Ctrl-C and SIGKILL in turn (the first drawn), each of a random volunteer that is up,
    every ``every`` s, each rejoining ``down`` s later; the bootstrap stopped with Ctrl-C once
    in the middle half and restarted likewise. At most one volunteer is down at a time, and
    every restart falls before ``seconds``. A pure function of its arguments."""
    rng = random.Random(seed)
    plan: list[Fault] = []
    up_at = dict.fromkeys(names, 0.0)
    kinds = [SIGINT, SIGKILL] if rng.random() < 0.5 else [SIGKILL, SIGINT]
    t, n = rng.uniform(*every), 0
    while t + down[1] < seconds:
        candidates = [x for x in names if up_at[x] <= t]
        if candidates:
            who, back = rng.choice(candidates), t + rng.uniform(*down)
            up_at = dict.fromkeys(names, back)  # nobody else leaves before it is back
            plan += [Fault(round(t, 2), who, kinds[n % 2]), Fault(round(back, 2), who, RESTART)]
            n += 1
        t = max(t + rng.uniform(*every), max(up_at.values()))
    if seconds > 2 * down[1]:
        t = rng.uniform(0.25 * seconds, max(0.25 * seconds, 0.75 * seconds - down[1]))
        back = t + rng.uniform(*down)
        plan += [Fault(round(t, 2), BOOTSTRAP, SIGINT), Fault(round(back, 2), BOOTSTRAP, RESTART)]
    return sorted(plan, key=lambda f: (f.t, f.action != RESTART, f.target))


def view_bound(manifest: RunManifest) -> float:
    """Seconds a certificate may take while one member is gone: one failed view and the next,
    at the pacemaker's backed-off timeout (``chaos_verify.stall_allowance``)."""
    return stall_allowance(manifest, failed_views=1)


def went_backwards(versions: Mapping[str, Sequence[tuple[float, int]]]) -> list[dict[str, Any]]:
    """Each (node, t, from, to) where a node's reported version fell, in one life or across a
    rejoin (``versions``: each node's (t, version) in order, over all its lives)."""
    out = []
    for node, seq in versions.items():
        best = 0
        for t, v in seq:
            if v < best:
                out.append({"node": node, "t": t, "from": best, "to": v})
            best = max(best, v)
    return out


class Starver:
    """SIGSTOP/SIGCONT of one volunteer's process group: stopped ``duty`` of every ``period``.
    ``node`` gives its current process (a supervisor may have started it again)."""

    def __init__(self, node: Callable[[], NodeProc], duty: float, period: float) -> None:
        self.node, self.duty, self.period = node, duty, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="starver")

    def start(self) -> None:
        if self.duty > 0:
            self._thread.start()

    def _signal(self, sig: int) -> None:
        """``sig`` to the node's process group and to its DHT daemons' (their own group)."""
        pid = self.node().proc.pid
        groups = {pid}
        for child, _ in descendants([pid]):
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(child))
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._signal(signal.SIGSTOP)
            self._stop.wait(self.duty * self.period)
            self._signal(signal.SIGCONT)
            self._stop.wait((1 - self.duty) * self.period)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._signal(signal.SIGCONT)


def ctrl_c(node: NodeProc, timeout: float = 90.0) -> dict[str, Any]:
    """Ctrl-C as a terminal sends it (SIGINT to the process group); how the volunteer stopped."""
    t = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.proc.pid, signal.SIGINT)
    try:
        code: int | None = node.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
        kill_group(node.proc)
    tail = node.text()[-4000:]
    return {
        "node": node.name,
        "exit_code": code,
        "seconds": round(time.monotonic() - t, 1),
        "clean": code == 0 and "stopped cleanly" in tail,
        "said": next((ln for ln in reversed(tail.splitlines()) if ln.startswith("stopped")), None),
    }


def stop_bootstrap(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int | None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return None


def run(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cfg = DemoConfig(
        nodes=a.volunteers,
        model=a.model,
        inner_steps=a.inner_steps,
        grace=a.grace,
        agree_timeout=a.agree_timeout,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        committee_size=a.committee_size,
    )
    seconds = a.minutes * 60
    names = [f"v{i}" for i in range(a.volunteers)]
    starved = names[-1]
    plan = make_plan(a.seed, seconds, names[:-1], a.every, a.down)
    executed: list[dict[str, Any]] = []
    stops: list[dict[str, Any]] = []
    say = lambda s: print(f"[soak {time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    with LocalNetwork(workdir, cfg) as net:
        say(f"bootstrap at {net.start_bootstrap()}")
        boot = net.procs[0]
        keys = {name: Identity.generate() for name in names}
        run_id = net.publish_run(list(keys.values()), view_timeout=a.view_timeout)
        for name in names:
            net.start_node(name, keys[name], until_version=FOREVER)
        net.wait_versions(1, net.nodes, a.start_timeout, say)
        victim = lambda: next(n for n in net.nodes if n.name == starved)  # noqa: E731
        starver = Starver(victim, a.starve_duty, a.starve_period)
        starver.start()
        t0 = time.time()
        watch = Watch(net, t0)
        watch.poll()
        say(f"soak for {seconds:.0f} s: {len(plan)} faults; {starved} starved of CPU")
        pending = list(plan)
        try:
            while time.time() - t0 < seconds:
                while pending and pending[0].t <= time.time() - t0:
                    f = pending.pop(0)
                    executed.append(asdict(f) | {"t_actual": round(time.time() - t0, 2)})
                    say(f"{f.action} {f.target}")
                    if f.target == BOOTSTRAP:
                        if f.action == SIGINT:
                            executed[-1]["exit_code"] = stop_bootstrap(boot)
                        else:
                            boot = restart_bootstrap(net, len(executed))
                        continue
                    node = next(n for n in net.nodes if n.name == f.target)
                    if f.action == RESTART:
                        net.start_node(f.target, keys[f.target], until_version=FOREVER)
                        watch.lives[f.target].append(Life(f.target, time.time()))
                        watch.down.discard(f.target)
                        continue
                    watch.poll()
                    if f.action == SIGINT:
                        stops.append(ctrl_c(node) | {"t": executed[-1]["t_actual"]})
                    else:
                        node.kill()
                    watch.lives[f.target][-1].ended = time.time()
                    watch.down.add(f.target)
                watch.poll()
                supervise(net, watch, keys, a.supervisor_delay, executed, t0, say)
                time.sleep(0.5)
        finally:
            starver.close()
        t_end = time.time()
        say("soak over; settling")
        settled = settle(net, watch, a.settle)
        boot_up = boot.poll() is None
        net.close()
    for lives in watch.lives.values():
        lives[-1].ended = lives[-1].ended or t_end
    return analyse(
        a, net, watch, run_id, plan, executed, stops, starved, t0, t_end, settled, boot_up
    )


def supervise(
    net: LocalNetwork,
    watch: Watch,
    keys: Mapping[str, Identity],
    delay: float,
    executed: list[dict[str, Any]],
    t0: float,
    say: Any,
) -> None:
    """Start again a volunteer that exited on its own, ``delay`` s after (Restart=on-failure)."""
    for n in list(net.nodes):
        life = watch.lives[n.name][-1]
        due = life.ended is not None and time.time() - life.ended >= delay
        if life.exit is not None and due and n.name not in watch.down:
            say(f"{n.name} exited on its own ({life.exit['error']}); restarting it")
            now = time.time()
            executed.append(
                {"t": None, "target": n.name, "action": RESTART, "t_actual": round(now - t0, 2)}
                | {"by": "supervisor"}
            )
            net.start_node(n.name, keys[n.name], until_version=FOREVER)
            watch.lives[n.name].append(Life(n.name, now))


def analyse(
    a: argparse.Namespace,
    net: LocalNetwork,
    watch: Watch,
    run_id: str,
    plan: list[Fault],
    executed: list[dict[str, Any]],
    stops: list[dict[str, Any]],
    starved: str,
    t0: float,
    t_end: float,
    settled: bool,
    boot_up: bool,
) -> dict[str, Any]:
    manifest = net.manifest
    nodes = {n.name: n for n in net.nodes}
    node_logs = {
        p: p.read_text(errors="replace") for n in nodes.values() for p in n.dir.glob("*.log")
    }
    boot_logs = {p: p.read_text(errors="replace") for p in net.workdir.glob("bootstrap*.log")}
    times = certified_times(node_logs.values())
    bound = view_bound(manifest)
    all_gaps = gaps(times, t0, t_end)
    stalls = [asdict(g) for g in all_gaps if g.seconds > bound]
    v_start = max((v for v, t in times.items() if t <= t0), default=0)
    v_end = max((v for v, t in times.items() if t <= t_end), default=0)
    reports = {
        name: verify_state_dir(n.dir / "state", run_id, manifest) for name, n in nodes.items()
    }
    lost = lost_versions(reports, times, watch.applied)
    backwards = went_backwards(watch.versions)
    lost_all = sorted(set(lost["lost"]) | {b["from"] for b in backwards})
    corrupt = {name: r.problems for name, r in reports.items() if r.problems}
    logs: dict[str, dict[str, Any]] = {}
    for path, text in sorted({**node_logs, **boot_logs}.items()):
        tb = text.find("Traceback")
        logs[str(path.relative_to(net.workdir))] = {
            "tracebacks": text.count("Traceback"),
            "first_traceback": text[tb : tb + 2500] if tb >= 0 else None,
        }
    tracebacks = sum(d["tracebacks"] for d in logs.values())
    crashes = [e for e in watch.exits if e["code"] != 2]
    rules = manifest.rules
    result: dict[str, Any] = {
        "bench": "soak",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
        "commit": _commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "config": {k: v for k, v in vars(a).items() if k not in ("json", "out")},
        "manifest": {
            "committee_size": manifest.committee_size,
            "quorum": manifest.quorum,
            "inner_steps": manifest.inner_steps,
            "grace": rules.grace,
            "agree_timeout": rules.agree_timeout,
            "view_timeout": rules.view_timeout_s,
            "view_timeout_max": rules.view_timeout_max_s,
        },
        "run_id": run_id,
        "soak_seconds": round(t_end - t0, 1),
        "starved": starved,
        "plan": [asdict(f) for f in plan],
        "executed": executed,
        "ctrl_c": stops,
        "versions": {
            "at_start": v_start,
            "at_end": v_end,
            "certified": v_end - v_start,
            "after_settle": max(watch.applied.values(), default=0),
        },
        "cert_times": {str(v): round(t - t0, 2) for v, t in sorted(times.items())},
        "view_bound_s": bound,
        "longest_gap_s": max(g.seconds for g in all_gaps),
        "stalls": stalls,
        "lost_versions": lost_all,
        "forks": lost["forks"],
        "forgotten": lost["forgotten"],
        "went_backwards": backwards,
        "corrupt_states": len(corrupt),
        "corrupt": corrupt,
        "states": {name: report_dict(r) for name, r in reports.items()},
        "exits": watch.exits,
        "crashes": crashes,
        "settled": settled,
        "bootstrap_up_at_end": boot_up,
        "tracebacks": tracebacks,
        "logs": logs,
        "versions_by_node": dict(watch.versions),
    }
    unclean = [s for s in stops if not s["clean"]]
    result["targets"] = {
        "stalls_beyond_view_bound": len(stalls),
        "lost_versions": len(lost_all),
        "corrupt_states": len(corrupt),
        "tracebacks": tracebacks,
        "crashes": len(crashes),
        "unclean_ctrl_c": len(unclean),
        "met": not (stalls or lost_all or corrupt or tracebacks or crashes or unclean),
    }
    return result


def summary(res: dict[str, Any]) -> str:
    """One screen: the figures the issue asks for, then where each finding is."""
    t, v, ex = res["targets"], res["versions"], res["executed"]
    count = lambda action, target=None: sum(  # noqa: E731
        e["action"] == action and (target is None or (e["target"] == BOOTSTRAP) == target)
        for e in ex
    )
    lines = [
        f"soak: {res['config']['volunteers']} volunteers, {res['soak_seconds']:.0f} s, "
        f"{count(SIGINT, False)} Ctrl-C and {count(SIGKILL)} SIGKILL rejoined, "
        f"{count(SIGINT, True)} bootstrap restart, {res['starved']} starved "
        f"({res['config']['starve_duty']:.0%} stopped)",
        f"versions certified         {v['certified']} ({v['at_start']} -> {v['at_end']}; "
        f"{v['after_settle']} after settling)",
        f"longest gap                {res['longest_gap_s']:.1f} s",
        f"stalls beyond view bound   {t['stalls_beyond_view_bound']} (bound "
        f"{res['view_bound_s']:.0f} s)"
        + "".join(
            f"\n  after v{s['after']}: {s['seconds']:.0f} s from t={s['start']:.0f} s"
            for s in res["stalls"]
        ),
        f"lost versions              {t['lost_versions']} {res['lost_versions'] or ''}"
        + (f" (went backwards: {res['went_backwards']})" if res["went_backwards"] else ""),
        f"corrupt states             {t['corrupt_states']} {res['corrupt'] or ''}",
        f"tracebacks                 {t['tracebacks']}"
        + "".join(f"\n  {p}: {d['tracebacks']}" for p, d in res["logs"].items() if d["tracebacks"]),
        f"crashes                    {t['crashes']}"
        + "".join(f"\n  {c['node']} at {c['t']} s: {c['error']}" for c in res["crashes"]),
        f"Ctrl-C stopped cleanly     {sum(s['clean'] for s in res['ctrl_c'])} of "
        f"{len(res['ctrl_c'])}"
        + "".join(
            f"\n  {s['node']}: exit {s['exit_code']} after {s['seconds']} s ({s['said']})"
            for s in res["ctrl_c"]
            if not s["clean"]
        ),
        f"exits nobody asked for     {len(res['exits'])}"
        + "".join(f"\n  {e['node']} at {e['t']} s: {e['error']}" for e in res["exits"][:5]),
        f"target (0 stalls, 0 lost, 0 corrupt, 0 tracebacks): {'met' if t['met'] else 'NOT met'}",
    ]
    return "\n".join(lines)


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def pair(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(","))
    return lo, hi


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--volunteers", type=int, default=4, choices=range(3, 7), metavar="3-6")
    ap.add_argument("--minutes", type=float, default=20.0, help="length of the soak")
    ap.add_argument("--seed", type=int, default=0, help="of the fault plan")
    ap.add_argument("--every", type=pair, default=(40.0, 90.0), help="s between faults: LO,HI")
    ap.add_argument("--down", type=pair, default=(5.0, 20.0), help="s until the rejoin: LO,HI")
    ap.add_argument("--starve-duty", type=float, default=0.6, help="share of time SIGSTOPped")
    ap.add_argument("--starve-period", type=float, default=5.0, help="s per stop/continue cycle")
    ap.add_argument("--settle", type=float, default=180.0, help="s to agree after the soak")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="s to reach version 1")
    ap.add_argument("--supervisor-delay", type=float, default=5.0)
    ap.add_argument("--model", default="gemma-tiny")
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--committee-size", type=int, default=4)
    ap.add_argument("--grace", type=float, default=15.0)
    ap.add_argument("--agree-timeout", type=float, default=5.0)
    ap.add_argument("--view-timeout", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=Path("bench/out/soak"))
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = ap.parse_args()
    if not 0 <= a.starve_duty < 1:
        ap.error("--starve-duty must be in [0, 1)")
    workdir = a.out / f"soak-s{a.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True, exist_ok=True)
    res = run(a, workdir)
    (workdir / "soak.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1) if a.json else summary(res))
    print(f"logs and soak.json in {workdir}", file=sys.stderr)
    return 0 if res["targets"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
