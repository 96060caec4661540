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
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pdiloco.errors import ConfigError, UserError
from p2pdiloco.harness.demo_config import DemoConfig, NodeProc
from p2pdiloco.harness.demo_summary import DemoResult, summarize
from p2pdiloco.net.dht import DHTPlane
from p2pdiloco.net.manifests import create_manifest, publish_manifest
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.signals import default_in_fork
from p2pdiloco.sync.rules import check_supported
from p2pdiloco.train.attacks import ATTACKS
from p2pdiloco.train.models import get_spec


def _free_port_pair() -> int:
    """A port P with P + 1 free too (the bootstrap's gossip host takes --port + 1), drawn below
    Linux's ephemeral range (32768-60999), where outgoing connections take theirs: a port the
    kernel handed out is often followed by one it hands out next."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20_000, 32_000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise UserError("no two free adjacent TCP ports on 127.0.0.1 for the bootstrap")


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
    _stop_all([proc], timeout)


def _stop_all(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """SIGTERM every process group at once, wait for all within ``timeout``, SIGKILL the rest."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _exit_on_sigterm() -> Any:
    """In the main thread, make SIGTERM raise SystemExit(143), so that a ``with LocalNetwork``
    stops its processes when the demo or a bench is terminated (Python's default action ends
    the process at once and left every node running). Returns the handler it replaced (None
    off the main thread). A forked child that inherited it takes the default action."""
    if threading.current_thread() is not threading.main_thread():
        return None
    owner = os.getpid()

    def handler(signum: int, _frame: object) -> None:
        if not default_in_fork(owner, signum):
            raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


class LocalNetwork:
    """A bootstrap server and training nodes as processes on loopback (the demo and the tests).

    Use as a context manager: leaving it stops every process (SIGTERM, then SIGKILL), or with
    ``kill_on_exit`` SIGKILLs them all at once, as a crash would (``kill``).
    """

    def __init__(self, workdir: Path, cfg: DemoConfig, *, kill_on_exit: bool = False) -> None:
        self.workdir = workdir
        self.cfg = cfg
        # For tests that assert inside the block and do not test the clean stop: three nodes'
        # clean stop and the bootstrap's took 6-7 s of every network test, a kill 0.3 s.
        self.kill_on_exit = kill_on_exit
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.boot_proc: subprocess.Popen[bytes] | None = None
        self.nodes: list[NodeProc] = []
        self.boot_addr = ""
        self.run_id = ""
        self.manifest: Any = None
        self._on_term: Any = None
        self._boot_port = 0

    def __enter__(self) -> LocalNetwork:
        self._on_term = _exit_on_sigterm()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill() if self.kill_on_exit else self.close()
        finally:
            if self._on_term is not None:
                signal.signal(signal.SIGTERM, self._on_term)

    def close(self) -> None:
        """Stop every process (idempotent): the nodes together, then the bootstrap (a node's
        clean stop may still talk to the DHT). One node's clean stop takes a second or two;
        one after another they added 5-10 s to every network test."""
        nodes = [p for p in self.procs if p is not self.boot_proc]
        _stop_all(nodes)
        if self.boot_proc is not None:
            _stop(self.boot_proc)

    def kill(self) -> None:
        """SIGKILL every process group at once, nodes and bootstrap (idempotent); their DHT
        processes and daemons, in groups of their own, stop once they see them gone
        (``net.lifeline``), as after a crash."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in live:
            p.wait(30)

    def start_bootstrap(self) -> str:
        Identity.generate().save(self.workdir / "bootstrap.key")
        self._boot_port = _free_port_pair()
        return self._spawn_bootstrap()

    def restart_bootstrap(self) -> str:
        """Stop the bootstrap and start a fresh process with the same key and port: an empty
        DHT node that the run's members must refill."""
        assert self.boot_proc is not None
        _stop(self.boot_proc)
        self.procs.remove(self.boot_proc)
        return self._spawn_bootstrap()

    def _spawn_bootstrap(self) -> str:
        key_path = self.workdir / "bootstrap.key"
        boot_key = Identity.load(key_path)
        port = self._boot_port
        log = self.workdir / "bootstrap.log"
        if log.exists():  # a restart: the first run's log stays readable
            log = self.workdir / f"bootstrap.{len(self.procs)}.log"
        boot = _spawn(
            [
                "bootstrap",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--http-host",
                "127.0.0.1",
                "--http-port",
                "0",
                "--identity",
                str(key_path),
            ],
            log,
            self.env,
        )
        self.procs.append(boot)
        self.boot_proc = boot
        self.boot_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_key.peer_id}"
        _wait(lambda: "HTTP:" in log.read_text(errors="replace"), 120, "the bootstrap", boot, log)
        return self.boot_addr

    def publish_run(self, keys: list[Identity], **overrides: Any) -> str:
        """Sign and publish the run manifest; the first k keys form the genesis committee.

        ``overrides`` replace manifest fields; a ``SyncRules`` field name (``staleness=0``)
        replaces that rule inside ``rules``.
        """
        cfg = self.cfg
        k = min(cfg.committee_size, len(keys))
        total = cfg.rounds * cfg.inner_steps * 2
        fields: dict[str, Any] = dict(
            name="demo",
            model=cfg.model,
            data="embedded",
            seed=0,
            inner_steps=cfg.inner_steps,
            committee_size=k,
            quorum=(2 * k) // 3 + 1,
            genesis_committee=[key.peer_id for key in keys[:k]],
            compression=cfg.compression,
            inner={
                "lr": cfg.inner_lr,
                "batch_size": cfg.batch_size,
                "seq_len": cfg.seq_len,
                "warmup_steps": max(1, total // 10),
                "total_steps": total,
            },
            outer={
                "lr": cfg.outer_lr,
                "momentum": cfg.outer_momentum,
                "fragments": cfg.fragments,
            },
        )
        rules: dict[str, Any] = dict(
            aggregation=cfg.aggregation,
            clone_factor=cfg.clone_factor,
            grace=cfg.grace,
            agree_timeout=cfg.agree_timeout,
            update_codec=cfg.update_compression,
        )
        for key, value in overrides.items():
            (rules if key in SyncRules.model_fields else fields)[key] = value
        fields["rules"] = rules | dict(fields.get("rules", {}))
        run_id, manifest, raw = create_manifest(keys[0], **fields)
        check_supported(manifest)
        with DHTPlane(Identity.generate(), initial_peers=[self.boot_addr], client_mode=True) as dht:
            publish_manifest(dht, run_id, manifest, raw)
        self.run_id, self.manifest = run_id, manifest
        return run_id

    def start_node(
        self,
        name: str,
        key: Identity,
        *,
        until_version: int,
        adversary: str | None = None,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        target: Sequence[str] | None = None,
    ) -> NodeProc:
        """Start (or restart, with the same directory) one ``p2pdiloco join`` process (``env``:
        extra environment, say ``P2PDILOCO_FAILPOINTS``; ``target``: what to join, by default
        ``--run`` and the published run's id)."""
        d = self.workdir / name
        d.mkdir(exist_ok=True)
        if not (d / "identity.key").exists():
            key.save(d / "identity.key")
        args = [
            "join",
            *(target if target is not None else ("--run", self.run_id)),
            "--bootstrap",
            self.boot_addr,
            "--identity",
            str(d / "identity.key"),
            "--host",
            "127.0.0.1",
            "--no-tui",
            "--state-dir",
            str(d / "state"),
            "--threads",
            "1",
            "--until-version",
            str(until_version),
            "--heartbeat-interval",
            "2",
            *(["--compute-share", str(share)] if (share := self.cfg.compute_share) < 1 else []),
            *extra,  # after: a node's own flags win (the last of a repeated option counts)
        ]
        if adversary:
            args += ["--adversary", adversary]
        log_name = "node.log" if not (d / "node.log").exists() else f"node.{len(self.procs)}.log"
        p = _spawn(args, d / log_name, {**self.env, **(env or {}), "XDG_DATA_HOME": str(d)})
        self.procs.append(p)
        node = NodeProc(name, key, d, p, adversary, d / log_name)
        self.nodes = [n for n in self.nodes if n.name != name] + [node]
        return node

    def wait_versions(
        self,
        target: int,
        nodes: Sequence[NodeProc],
        timeout: float,
        say: Callable[[str], None] = lambda _: None,
    ) -> list[dict[str, Any]]:
        """Poll status files until every node in ``nodes`` applied ``target``; their statuses.

        Raises UserError (with the node's log tail) if one exits or fails, or on timeout.
        """
        last = ""
        deadline = time.monotonic() + timeout
        while True:
            statuses = [n.status() for n in nodes]
            for n, st in zip(nodes, statuses, strict=True):
                if n.proc.poll() is not None:
                    raise UserError(f"{n.name} exited with {n.proc.returncode}:\n{n.log_tail()}")
                if st.get("error"):
                    raise UserError(f"{n.name} failed: {st['error']}\n{n.log_tail()}")
            versions = [int(s.get("version", 0)) for s in statuses]
            line = "versions " + " ".join(
                f"{n.name}={v}" for n, v in zip(nodes, versions, strict=True)
            )
            if line != last:
                say(line)
                last = line
            if min(versions) >= target:
                return statuses
            if time.monotonic() > deadline:
                tails = "".join(
                    f"\n--- {n.name}, last lines ---\n"
                    + "\n".join(n.log_tail(4000).splitlines()[-12:])
                    for n in nodes
                )
                raise UserError(
                    f"timed out after {timeout:.0f} s waiting for version {target} ({line}){tails}"
                )
            time.sleep(0.5)


def run_demo(cfg: DemoConfig, progress: Callable[[str], None] | None = None) -> DemoResult:
    """Run the network until every node applied version ``cfg.versions``; raise UserError with
    the failing node's log tail if a node dies or the demo times out."""
    if cfg.nodes < 2 or cfg.rounds < 1:
        raise ConfigError("--nodes must be at least 2 and --rounds at least 1")
    if cfg.adversary is not None and cfg.adversary not in ATTACKS:
        raise ConfigError(f"unknown --adversary '{cfg.adversary}'; one of {', '.join(ATTACKS)}")
    get_spec(cfg.model)
    say = progress or (lambda _: None)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if cfg.workdir is None:
            workdir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="p2pdiloco-demo-"))
            )
        else:
            workdir = cfg.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        net = stack.enter_context(LocalNetwork(workdir, cfg))
        say(f"bootstrap up at {net.start_bootstrap()}")
        keys = [Identity.generate() for _ in range(cfg.nodes)]
        run_id = net.publish_run(keys)
        frags = f", {cfg.fragments} fragments" if cfg.fragments > 1 else ""
        say(f"run {run_id[:12]} published: {cfg.model}, H={cfg.inner_steps}{frags}")
        nodes = [
            net.start_node(
                f"node{i}",
                key,
                until_version=cfg.versions,
                adversary=cfg.adversary if i == cfg.nodes - 1 else None,
            )
            for i, key in enumerate(keys)
        ]
        if cfg.adversary:
            say(f"{cfg.nodes} nodes started; node{cfg.nodes - 1} attacks with {cfg.adversary}")
        else:
            say(f"{cfg.nodes} nodes started")
        statuses = net.wait_versions(cfg.versions, nodes, cfg.timeout, say)
        net.close()
        say("nodes stopped; verifying certificates and evaluating")
        return summarize(cfg, nodes, statuses, net.manifest, run_id, workdir, t0)
    raise AssertionError("unreachable")


def _wait(probe: Callable[[], bool], timeout: float, what: str, proc: Any, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if proc.poll() is not None or time.monotonic() > deadline:
            why = (
                f"{what} exited with {proc.poll()}"
                if proc.poll() is not None
                else f"timed out after {timeout:.0f} s waiting for {what}"
            )
            raise UserError(f"{why}:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
