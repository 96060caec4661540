"""Chaos on real processes: a local network trains while random nodes are SIGKILLed and restarted.

A bootstrap and N ``p2pdiloco join`` nodes (``p2pdiloco.harness.demo.LocalNetwork``: separate
processes, each with its own key, DHT daemon and gossip host, on loopback) train gemma-tiny. Once
every node applied version 1, the chaos begins: every 20-40 s (seeded) a random live node's whole
process group is SIGKILLed, and 5-15 s later it is restarted with the same key and state directory;
the bootstrap is killed and restarted (same key and port) once. After ``--minutes`` the schedule
stops, the nodes get ``--settle`` seconds to agree on the newest version, they are stopped
(SIGTERM), and every state directory is verified against its certificates.

It reports versions certified during the chaos, rounds that stalled past the grace window (and
the longest gap), certified versions lost, corrupt states, tracebacks in node logs and the
goodput; the definitions are in ``bench/chaos_verify.py``. Target: 0 stalls past grace, 0 lost
versions, 0 corrupt states, no traceback. The JSON holds the kill/restart schedule (planned and
actual times, seconds after the chaos began) and each node's measured speed, so the simulator
(``p2pdiloco/sim/``) can replay the same schedule; its goodput goes in ``simulator_prediction``,
left null here. Figures (PNG, SVG: certified version against time with the kill and restart
marks) go beside the JSON.

    .venv/bin/python -m bench.chaos                       # 6 nodes, 4 minutes, seed 0
    .venv/bin/python -m bench.chaos --minutes 8 --seed 3 --out bench/out/chaos
    .venv/bin/python -m bench.chaos --no-chaos            # the same run, nobody killed

Run it alone on a small machine (``flock /tmp/heavy.lock ...``): six nodes share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos_plot import plot
from bench.chaos_timings import timings
from bench.chaos_verify import (
    BOOTSTRAP,
    Event,
    certified_times,
    credited_tokens,
    gaps,
    lost_versions,
    make_schedule,
    most_out_at_once,
    report_dict,
    stall_allowance,
    verify_state_dir,
)
from p2pdiloco.harness.demo import LocalNetwork, _spawn
from p2pdiloco.harness.demo_config import DemoConfig, NodeProc
from p2pdiloco.protocol.identity import Identity

FOREVER = 10**6  # --until-version: the nodes train until stopped


@dataclass
class Life:
    """One life of a node: from its start to its kill (or the end)."""

    node: str
    started: float  # epoch seconds
    ended: float | None = None
    tokens: int = 0  # tokens_trained in its last status file
    train_s: float = 0.0  # seconds in inner steps, same file
    tokens_at: dict[str, int] = field(default_factory=dict)  # "start"/"end": tokens at chaos bounds
    caught_up: float | None = None  # first status at the network's newest version
    version: int | None = None  # the version in its own newest status file
    exit: dict[str, Any] | None = None  # how it ended, when it exited without being killed


class Watch:
    """Polls the status files: versions over time, each life's tokens, exits nobody asked for."""

    def __init__(self, net: LocalNetwork, t0: float) -> None:
        self.net, self.t0 = net, t0
        # First lives began before the chaos: their status files count from the start.
        self.lives: dict[str, list[Life]] = {n.name: [Life(n.name, 0.0)] for n in net.nodes}
        self.versions: dict[str, list[tuple[float, int]]] = {n.name: [] for n in net.nodes}
        self.applied: dict[str, int] = {}  # newest version each node said it applied
        self.down: set[str] = set()
        self.exits: list[dict[str, Any]] = []  # a node that exited on its own, and why

    def poll(self) -> None:
        now = time.time()
        newest = max(self.applied.values(), default=0)
        for n in self.net.nodes:
            if n.name in self.down:
                continue
            life = self.lives[n.name][-1]
            if n.proc.poll() is not None and life.exit is None:
                text = n.text()
                errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
                life.ended = now
                life.exit = {
                    "node": n.name,
                    "t": round(now - self.t0, 1),
                    "code": n.proc.returncode,
                    "error": errors[-1] if errors else None,
                    "tail": text[-3000:],
                }
                self.exits.append(life.exit)
            path = n.dir / "state" / "status.json"
            try:
                fresh = path.stat().st_mtime >= life.started
            except OSError:
                fresh = False
            st = n.status() if fresh else {}
            if not st:
                continue
            v = int(st.get("version", 0))
            life.tokens, life.train_s = (
                int(st.get("tokens_trained", 0)),
                float(st.get("train_seconds", 0)),
            )
            if not self.versions[n.name] or self.versions[n.name][-1][1] != v:
                self.versions[n.name].append((round(now - self.t0, 2), v))
            self.applied[n.name] = max(v, self.applied.get(n.name, 0))
            life.version = v
            if life.caught_up is None and v >= newest and life.started > self.t0:
                life.caught_up = now

    def mark(self, key: str) -> None:
        """Record each live life's tokens at the chaos start or end."""
        for lives in self.lives.values():
            if lives[-1].ended is None:
                lives[-1].tokens_at[key] = lives[-1].tokens


def restart_bootstrap(net: LocalNetwork, n: int) -> subprocess.Popen[bytes]:
    """The bootstrap again: same key, same port (the nodes were given its address once)."""
    port = re.search(r"/tcp/(\d+)/", net.boot_addr)
    assert port is not None
    log = net.workdir / f"bootstrap.{n}.log"
    proc = _spawn(
        [
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            port.group(1),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            "0",
            "--identity",
            str(net.workdir / "bootstrap.key"),
        ],
        log,
        net.env,
    )
    net.procs.append(proc)
    return proc


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def run(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cfg = DemoConfig(
        nodes=a.nodes,
        model=a.model,
        inner_steps=a.inner_steps,
        grace=a.grace,
        agree_timeout=a.agree_timeout,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        committee_size=a.committee_size,
        fragments=a.fragments,
    )
    seconds = a.minutes * 60
    names = [f"node{i}" for i in range(a.nodes)]
    schedule = [] if a.no_chaos else make_schedule(a.seed, seconds, names, a.every, a.down)
    done: list[dict[str, Any]] = []
    say = lambda s: print(f"[chaos {time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    with LocalNetwork(workdir, cfg) as net:
        say(f"bootstrap at {net.start_bootstrap()}")
        boot = net.procs[0]
        keys = [Identity.generate() for _ in range(a.nodes)]
        run_id = net.publish_run(keys, view_timeout=a.view_timeout)
        by_name = {name: key for name, key in zip(names, keys, strict=True)}
        for name in names:
            net.start_node(name, by_name[name], until_version=FOREVER)
        net.wait_versions(1, net.nodes, 900, say)
        t0 = time.time()
        watch = Watch(net, t0)
        watch.poll()
        watch.mark("start")
        say(f"chaos for {seconds:.0f} s: {len(schedule)} events")
        pending = list(schedule)
        while time.time() - t0 < seconds:
            while pending and pending[0].t <= time.time() - t0:
                ev = pending.pop(0)
                now = time.time()
                done.append(asdict(ev) | {"t_actual": round(now - t0, 2)})
                say(f"{ev.action} {ev.target}")
                if ev.target == BOOTSTRAP:
                    if ev.action == "kill":
                        kill_group(boot)
                    else:
                        boot = restart_bootstrap(net, len(done))
                    continue
                node = next(n for n in net.nodes if n.name == ev.target)
                if ev.action == "kill":
                    watch.poll()
                    node.kill()
                    watch.lives[ev.target][-1].ended = now
                    watch.down.add(ev.target)
                else:
                    net.start_node(ev.target, by_name[ev.target], until_version=FOREVER)
                    watch.lives[ev.target].append(Life(ev.target, now))
                    watch.down.discard(ev.target)
            watch.poll()
            for n in list(net.nodes):  # a supervisor (the systemd unit's Restart=on-failure)
                life = watch.lives[n.name][-1]
                due = life.ended is not None and time.time() - life.ended >= a.supervisor_delay
                if life.exit is not None and due and n.name not in watch.down:
                    now = time.time()
                    say(f"{n.name} exited on its own ({life.exit['error']}); restarting it")
                    done.append(
                        {
                            "t": None,
                            "target": n.name,
                            "action": "restart",
                            "t_actual": round(now - t0, 2),
                            "by": "supervisor",
                        }
                    )
                    net.start_node(n.name, by_name[n.name], until_version=FOREVER)
                    watch.lives[n.name].append(Life(n.name, now))
            time.sleep(0.5)
        t_end = time.time()
        watch.mark("end")
        say("chaos over; settling")
        settled = settle(net, watch, a.settle)
        boot_up = boot.poll() is None
        net.close()
    for lives in watch.lives.values():
        lives[-1].ended = lives[-1].ended or t_end
    return analyse(a, net, watch, run_id, schedule, done, t0, t_end, settled, boot_up, workdir)


def settle(net: LocalNetwork, watch: Watch, timeout: float) -> bool:
    """Wait until every node's current life holds the newest version seen; False on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        watch.poll()
        got = {watch.lives[n.name][-1].version for n in net.nodes if n.proc.poll() is None}
        if len(got) == 1 and got == {max(watch.applied.values())}:
            return True
        time.sleep(0.5)
    return False


def analyse(
    a: argparse.Namespace,
    net: LocalNetwork,
    watch: Watch,
    run_id: str,
    schedule: list[Event],
    done: list[dict[str, Any]],
    t0: float,
    t_end: float,
    settled: bool,
    boot_up: bool,
    workdir: Path,
) -> dict[str, Any]:
    manifest = net.manifest
    nodes: dict[str, NodeProc] = {n.name: n for n in net.nodes}
    logs = {
        p: p.read_text(errors="replace") for n in nodes.values() for p in n.dir.glob("node*.log")
    }
    times = certified_times(logs.values())
    allowance = stall_allowance(manifest)
    all_gaps = gaps(times, t0, t_end)
    stalls = [g for g in all_gaps if g.seconds > allowance]
    v_start = max((v for v, t in times.items() if t <= t0), default=0)
    v_end = max((v for v, t in times.items() if t <= t_end), default=0)
    out: dict[str, list[tuple[float, float]]] = {}
    for name, lives in watch.lives.items():
        for gone, back in zip(lives, [*lives[1:], None], strict=True):
            if gone.ended is not None and gone.ended < t_end:
                out.setdefault(name, []).append(
                    (gone.ended, (back.caught_up or back.ended or t_end) if back else t_end)
                )
    reports = {
        name: verify_state_dir(n.dir / "state", run_id, manifest) for name, n in nodes.items()
    }
    lost = lost_versions(reports, times, watch.applied)
    corrupt = {name: r.problems for name, r in reports.items() if r.problems}
    seconds = t_end - t0
    rates = {}
    trained = 0
    for name, lives in watch.lives.items():
        tok, sec = sum(life.tokens for life in lives), sum(life.train_s for life in lives)
        rates[name] = tok / sec if sec else 0.0
        for life in lives:
            end = life.tokens_at.get("end", life.tokens)
            trained += end - life.tokens_at.get("start", 0)
    could = sum(rates.values()) * seconds
    credited = credited_tokens(reports.values(), v_start, v_end)
    restarts = []
    for name, lives in watch.lives.items():
        for life in lives[1:]:
            restarts.append(
                {
                    "node": name,
                    "t": round(life.started - t0, 1),
                    "until": round((life.ended or t_end) - t0, 1),
                    "rejoin_s": round(life.caught_up - life.started, 1) if life.caught_up else None,
                }
            )
    node_logs: dict[str, dict[str, Any]] = {}
    for path, text in sorted(logs.items()):
        tb = text.find("Traceback")
        node_logs[str(path.relative_to(workdir))] = {
            "tracebacks": text.count("Traceback"),
            "errors": sum(" ERROR " in ln for ln in text.splitlines()),
            "first_traceback": text[tb : tb + 2500] if tb >= 0 else None,
        }
    tracebacks = sum(d["tracebacks"] for d in node_logs.values())
    # Exit code 2 is join's one-line refusal (UserError), e.g. no bootstrap answered: the
    # deployment's supervisor restarts it. Anything else is a crash.
    crashes = [e for e in watch.exits if e["code"] != 2]
    rules = manifest.rules
    result = {
        "bench": "chaos",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
        "commit": a.commit or _commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "config": {k: v for k, v in vars(a).items() if k not in ("json", "out", "commit")},
        "manifest": {
            "committee_size": manifest.committee_size,
            "quorum": manifest.quorum,
            "inner_steps": manifest.inner_steps,
            "fragments": manifest.outer.fragments,
            "batch_size": manifest.inner.batch_size,
            "seq_len": manifest.inner.seq_len,
            "grace": rules.grace,
            "agree_timeout": rules.agree_timeout,
            "view_timeout": rules.view_timeout_s,
            "min_quorum_fraction": rules.min_quorum_fraction,
            "linger": rules.linger,
        },
        "run_id": run_id,
        "chaos_seconds": round(seconds, 1),
        "schedule": [asdict(e) for e in schedule],
        "executed": done,
        "restarts": restarts,
        "versions": {
            "at_start": v_start,
            "at_end": v_end,
            "certified": v_end - v_start,
            "after_settle": max(watch.applied.values(), default=0),
        },
        "cert_times": {str(v): round(t - t0, 2) for v, t in sorted(times.items())},
        "stall_allowance_s": allowance,
        "max_gap_s": max(g.seconds for g in all_gaps),
        # Nodes out at once during each stall: more than committee_size - quorum can leave a
        # committee without its quorum until a view change seats live members.
        "stalls": [
            asdict(g)
            | {"most_nodes_out": most_out_at_once(out, t0 + g.start, t0 + g.start + g.seconds)}
            for g in stalls
        ],
        "lost_versions": lost["lost"],
        "forks": lost["forks"],
        "forgotten": lost["forgotten"],
        "corrupt_states": len(corrupt),
        "corrupt": corrupt,
        "states": {name: report_dict(r) for name, r in reports.items()},
        "exits": watch.exits,
        "crashes": crashes,
        "settled": settled,
        "bootstrap_up_at_end": boot_up,
        "tracebacks": tracebacks,
        "node_logs": node_logs,
        "timings": timings(logs.values()),  # what a round costs here, for the prediction
        "versions_by_node": {n: v for n, v in watch.versions.items()},
        "goodput": {
            "credited_tokens": credited,
            "trained_tokens": trained,
            "could_train_tokens": round(could),
            "tokens_per_second": {n: round(r, 1) for n, r in rates.items()},
            "goodput": round(credited / could, 4) if could else 0.0,
            "trained_share": round(trained / could, 4) if could else 0.0,
            "credited_share_of_trained": round(credited / trained, 4) if trained else 0.0,
            "definition": "tokens credited by the receipts of versions certified during the "
            "chaos / (sum over nodes of tokens trained / seconds in inner steps, all lives) x "
            "chaos seconds",
        },
        "simulator_prediction": {
            "goodput": None,
            "note": "to be filled by the discrete-event simulator (p2pdiloco/sim/, issue 12) "
            "replaying 'schedule' with these nodes' tokens_per_second and the manifest above",
        },
    }
    result["targets"] = {
        "stalls_past_grace": len(stalls),
        "lost_versions": len(lost["lost"]),
        "corrupt_states": len(corrupt),
        "tracebacks": tracebacks,
        "crashes": len(crashes),
        "met": not (stalls or lost["lost"] or corrupt or tracebacks or crashes),
    }
    return result


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--minutes", type=float, default=4.0, help="length of the chaos")
    ap.add_argument("--seed", type=int, default=0, help="of the kill schedule")
    ap.add_argument("--every", type=pair, default=(20.0, 40.0), help="s between kills: LO,HI")
    ap.add_argument("--down", type=pair, default=(5.0, 15.0), help="s until the restart: LO,HI")
    ap.add_argument("--no-chaos", action="store_true", help="the same run, nobody killed")
    ap.add_argument("--settle", type=float, default=120.0, help="s to agree after the chaos")
    ap.add_argument(
        "--supervisor-delay",
        type=float,
        default=5.0,
        help="s before a node that exited on its own is started again",
    )
    ap.add_argument("--model", default="gemma-tiny")
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--committee-size", type=int, default=4)
    ap.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo fragments")
    ap.add_argument("--grace", type=float, default=15.0)
    ap.add_argument("--agree-timeout", type=float, default=5.0)
    ap.add_argument("--view-timeout", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=Path("bench/out/chaos"))
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--commit", default="", help="what to record as the code's commit")
    a = ap.parse_args()
    stem = f"chaos-s{a.seed}" + (f"-f{a.fragments}" if a.fragments > 1 else "")
    stem += "-clean" if a.no_chaos else ""
    workdir = a.out / stem
    workdir.mkdir(parents=True, exist_ok=True)
    res = run(a, workdir)
    (a.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    figures = plot(res, a.out / stem)
    if a.json:
        print(json.dumps(res, indent=1))
        return 0 if res["targets"]["met"] else 1
    t, gp, v = res["targets"], res["goodput"], res["versions"]
    print(
        f"{a.nodes} nodes, {res['chaos_seconds']:.0f} s of chaos, "
        f"{sum(e['action'] == 'kill' for e in res['executed'])} kills; logs in {workdir}"
    )
    print(f"versions certified     {v['certified']} ({v['at_start']} -> {v['at_end']})")
    print(
        f"stalls past grace      {t['stalls_past_grace']} (longest gap {res['max_gap_s']:.1f} s, "
        f"allowance {res['stall_allowance_s']:.0f} s)"
    )
    print(f"lost versions          {t['lost_versions']} {res['lost_versions'] or ''}")
    print(f"corrupt states         {t['corrupt_states']} {res['corrupt'] or ''}")
    print(f"tracebacks / crashes   {t['tracebacks']} / {t['crashes']}")
    print(
        f"goodput                {gp['goodput']:.3f} (credited {gp['credited_tokens']} of "
        f"{gp['could_train_tokens']} tokens; trained {gp['trained_tokens']})"
    )
    print("simulator prediction   (not yet: p2pdiloco/sim/)")
    print(f"target (0 stalls, 0 lost, 0 corrupt): {'met' if t['met'] else 'NOT met'}")
    print("figures: " + ", ".join(map(str, figures)), file=sys.stderr)
    return 0 if t["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
