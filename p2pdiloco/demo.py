"""``p2pdiloco demo``: a whole network on this machine — one bootstrap and N training nodes.

Every part is the real one: separate processes, each with its own key, DHT daemon and gossip
host, on loopback; a signed run manifest in the DHT; deltas signed, compressed and screened;
versions certified by a quorum of the elected committee. The demo only starts the processes,
watches their status files, stops them, and then checks what they produced: it verifies the
certificate chain from genesis, re-hashes the final state against its certificate, and
evaluates the start and end models on the held-out split of the corpus.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pdiloco.errors import ConfigError, UserError
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.net.manifests import create_manifest, publish_manifest
from p2pdiloco.protocol.certificates import Certificate
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.sync.attacks import ATTACKS
from p2pdiloco.sync.certified import CertifiedState, genesis_state
from p2pdiloco.sync.fetch import verify_next
from p2pdiloco.train.checkpoint import CheckpointStore
from p2pdiloco.train.data import build_corpus, eval_batches
from p2pdiloco.train.inner import evaluate
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.tokenizer import load_tokenizer


@dataclass
class DemoConfig:
    nodes: int = 4  # training nodes (each a learner; the committee is drawn from them)
    rounds: int = 3  # certified versions to reach
    model: str = "gemma-tiny"
    inner_steps: int = 20  # H
    adversary: str | None = None  # the last node attacks with this kind
    aggregation: str = "trimmed_mean"
    compression: str = "int8"
    committee_size: int = 4
    outer_lr: float = 0.7
    outer_momentum: float = 0.5  # short runs: ADR 0006
    inner_lr: float = 4e-4
    batch_size: int = 8
    seq_len: int = 128
    grace: float = 60.0  # a round closes at 60 % of learners, or after this many seconds
    agree_timeout: float = 15.0
    timeout: float = 900.0  # whole demo
    workdir: Path | None = None  # keep logs and states here (default: a temporary directory)
    eval_batches: int = 8


@dataclass
class NodeProc:
    name: str
    identity: Identity
    dir: Path
    proc: subprocess.Popen[bytes]
    adversary: str | None = None

    def status(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.dir / "state" / "status.json").read_text()))
        except (OSError, ValueError):
            return {}

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / "node.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""


@dataclass
class DemoResult:
    versions: int
    loss_start: float
    loss_end: float
    seconds: float
    run_id: str
    committee: dict[int, list[str]]
    peers: dict[str, dict[str, Any]]
    rejected: dict[str, int]
    downloads: list[dict[str, Any]] = field(default_factory=list)
    workdir: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "versions": self.versions,
            "loss_start": self.loss_start,
            "loss_end": self.loss_end,
            "seconds": round(self.seconds, 1),
            "run_id": self.run_id,
            "committee": {str(k): v for k, v in self.committee.items()},
            "peers": self.peers,
            "rejected": self.rejected,
            "workdir": self.workdir,
        }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "p2pdiloco", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def run_demo(cfg: DemoConfig, progress: Callable[[str], None] | None = None) -> DemoResult:
    """Run the network until every node applied version ``cfg.rounds``; raise UserError with
    the failing node's log tail if a node dies or the demo times out."""
    if cfg.nodes < 2 or cfg.rounds < 1:
        raise ConfigError("--nodes must be at least 2 and --rounds at least 1")
    if cfg.adversary is not None and cfg.adversary not in ATTACKS:
        raise ConfigError(f"unknown --adversary '{cfg.adversary}'; one of {', '.join(ATTACKS)}")
    get_spec(cfg.model)
    say = progress or (lambda _: None)
    t0 = time.monotonic()
    tmp = None
    if cfg.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="p2pdiloco-demo-")
        workdir = Path(tmp.name)
    else:
        workdir = cfg.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        boot_key = Identity.generate()
        boot_key.save(workdir / "bootstrap.key")
        port = _free_port()
        boot = _spawn(
            [
                "bootstrap",
                "--host", "127.0.0.1",
                "--port", str(port),
                "--http-host", "127.0.0.1",
                "--http-port", "0",
                "--identity", str(workdir / "bootstrap.key"),
            ],
            workdir / "bootstrap.log",
            env,
        )  # fmt: skip
        procs.append(boot)
        boot_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_key.peer_id}"
        _wait(lambda: "HTTP:" in (workdir / "bootstrap.log").read_text(errors="replace"),
              60, "the bootstrap server to start", boot, workdir / "bootstrap.log")  # fmt: skip
        say(f"bootstrap up at {boot_addr}")

        keys = [Identity.generate() for _ in range(cfg.nodes)]
        k = min(cfg.committee_size, cfg.nodes)
        total = cfg.rounds * cfg.inner_steps * 2
        run_id, manifest, raw = create_manifest(
            keys[0],
            name="demo",
            model=cfg.model,
            data="embedded",
            seed=0,
            inner_steps=cfg.inner_steps,
            committee_size=k,
            quorum=(2 * k) // 3 + 1,
            genesis_committee=[key.peer_id for key in keys[:k]],
            compression=cfg.compression,
            aggregation=cfg.aggregation,
            inner={
                "lr": cfg.inner_lr,
                "batch_size": cfg.batch_size,
                "seq_len": cfg.seq_len,
                "warmup_steps": max(1, total // 10),
                "total_steps": total,
            },
            outer={"lr": cfg.outer_lr, "momentum": cfg.outer_momentum},
        )
        with DHTPlane(Identity.generate(), initial_peers=[boot_addr], client_mode=True) as dht:
            publish_manifest(dht, run_id, manifest, raw)
        say(f"run {run_id[:12]} published: {cfg.model}, H={cfg.inner_steps}, committee {k}")

        nodes: list[NodeProc] = []
        for i, key in enumerate(keys):
            d = workdir / f"node{i}"
            d.mkdir(exist_ok=True)
            key.save(d / "identity.key")
            adversary = cfg.adversary if (cfg.adversary and i == cfg.nodes - 1) else None
            args = [
                "join",
                "--run", run_id,
                "--bootstrap", boot_addr,
                "--identity", str(d / "identity.key"),
                "--host", "127.0.0.1",
                "--no-tui",
                "--state-dir", str(d / "state"),
                "--threads", "1",
                "--until-version", str(cfg.rounds),
                "--heartbeat-interval", "2",
                "--round-grace", str(cfg.grace),
                "--agree-timeout", str(cfg.agree_timeout),
            ]  # fmt: skip
            if adversary:
                args += ["--adversary", adversary]
            p = _spawn(args, d / "node.log", {**env, "XDG_DATA_HOME": str(d)})
            procs.append(p)
            nodes.append(NodeProc(f"node{i}", key, d, p, adversary))
        say(
            f"{cfg.nodes} nodes started"
            + (f" (node{cfg.nodes - 1} attacks: {cfg.adversary})" if cfg.adversary else "")
        )

        last = ""
        deadline = time.monotonic() + cfg.timeout
        while True:
            statuses = [n.status() for n in nodes]
            for n in nodes:
                if n.proc.poll() is not None:
                    raise UserError(f"{n.name} exited with {n.proc.returncode}:\n{n.log_tail()}")
            failed = [(n, s) for n, s in zip(nodes, statuses, strict=True) if s.get("error")]
            if failed:
                n, s = failed[0]
                raise UserError(f"{n.name} failed: {s['error']}\n{n.log_tail()}")
            versions = [int(s.get("version", 0)) for s in statuses]
            line = "versions " + " ".join(
                f"{n.name}={v}" for n, v in zip(nodes, versions, strict=True)
            )
            if line != last:
                say(line)
                last = line
            if min(versions) >= cfg.rounds:
                break
            if time.monotonic() > deadline:
                raise UserError(f"demo timed out after {cfg.timeout:.0f} s ({line})")
            time.sleep(1.0)

        final_statuses = [n.status() for n in nodes]
        for p in procs:
            _stop(p)
        say("nodes stopped; verifying certificates and evaluating")
        return _summarize(cfg, nodes, final_statuses, manifest, run_id, workdir, t0)
    finally:
        for p in procs:
            _stop(p)
        if tmp is not None:
            tmp.cleanup()


def _wait(probe: Callable[[], bool], timeout: float, what: str, proc: Any, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise UserError(
                f"timed out waiting for {what}:\n{log.read_text(errors='replace')[-2000:]}"
            )
        time.sleep(0.2)


def _summarize(
    cfg: DemoConfig,
    nodes: list[NodeProc],
    statuses: list[dict[str, Any]],
    manifest: Any,
    run_id: str,
    workdir: Path,
    t0: float,
) -> DemoResult:
    names = {n.identity.peer_id: n.name for n in nodes}
    # The certificate chain from genesis, verified exactly as a late joiner would.
    certs_dir = nodes[0].dir / "state" / "certs"
    chain: list[Certificate] = []
    prev: Certificate | None = None
    for path in sorted(certs_dir.glob("*.json")):
        prev = verify_next(run_id, manifest, prev, path.read_bytes())
        chain.append(prev)
    if not chain:
        raise UserError("no certified version was produced")
    final = chain[-1]
    ckpt = CheckpointStore(nodes[0].dir / "state" / "certified").load_latest(verify=True)
    if ckpt is None:
        raise UserError("node0 saved no certified state")
    state = CertifiedState.from_tensors(final.body.version, final, ckpt.tensors)
    if state.state_hash != final.body.state_hash or state.version != final.body.version:
        raise UserError("node0's saved state does not match the final certificate")

    spec = get_spec(cfg.model)
    corpus = build_corpus("embedded", load_tokenizer(spec.tokenizer), seq_len=cfg.seq_len)
    evals = eval_batches(corpus, batch_size=cfg.batch_size, max_batches=cfg.eval_batches)
    model = build_model(cfg.model, seed=0)
    start = genesis_state(manifest)
    _load(model, start)
    loss_start = evaluate(model, evals)
    _load(model, state)
    loss_end = evaluate(model, evals)

    accepted, rejected, tokens = Counter[str](), Counter[str](), Counter[str]()
    for c in chain:
        for a in c.body.accepted:
            accepted[a.peer_id] += 1
            tokens[a.peer_id] += a.tokens
        for r in c.body.rejected:
            rejected[r.peer_id] += 1
    # Submissions refused before aggregation (replays, stale, malformed), counted once each.
    seen_refusals: set[tuple[str, str]] = set()
    for s in statuses:
        for r in s.get("rejections", []):
            key = (r.get("peer_id", ""), r.get("digest") or r.get("reason", ""))
            if key not in seen_refusals and "screened out" not in r.get("reason", ""):
                seen_refusals.add(key)
                rejected[key[0]] += 1
    peers = {
        n.name: {
            "peer_id": n.identity.peer_id,
            "adversary": n.adversary,
            "accepted": accepted[n.identity.peer_id],
            "rejected": rejected[n.identity.peer_id],
            "tokens": tokens[n.identity.peer_id],
        }
        for n in nodes
    }
    return DemoResult(
        versions=final.body.version,
        loss_start=loss_start,
        loss_end=loss_end,
        seconds=time.monotonic() - t0,
        run_id=run_id,
        committee={c.body.version: [names.get(m, m) for m in c.body.committee] for c in chain},
        peers=peers,
        rejected={n.name: rejected[n.identity.peer_id] for n in nodes},
        workdir=str(workdir) if cfg.workdir else "",
    )


def _load(model: Any, state: CertifiedState) -> None:
    import torch

    with torch.no_grad():
        for n, p in param_state(model).items():
            p.copy_(state.params[n])
