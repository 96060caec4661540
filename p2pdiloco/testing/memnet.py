"""A whole run in one process: real runtimes, syncers, learners, signatures and tensors, wired
through the in-memory transport and plane instead of hivemind and libp2p.

For fast driver tests (a committee round in about a second) and, later, simulations. Every
node is the same code as in ``join``: a ``NodeRuntime`` on the caller's asyncio loop and a
``Trainer`` thread. Faults are injected through the hub (``down``, ``delay``) or by stopping a
node. Use inside a running loop::

    async with MemoryNetwork(tmp_path, nodes=4, rules={"grace": 3.0}) as net:
        await net.wait_for(lambda: net.min_version() >= 2, timeout=60)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.core.learner import LearnerMachine
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.net.plane import MemoryDirectory
from p2pdiloco.net.transport import MemoryHub
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.runtime.node_runtime import NodeRuntime, RuntimeConfig
from p2pdiloco.runtime.trainer import Trainer
from p2pdiloco.train.attacks import AttackConfig
from p2pdiloco.train.data import PackedCorpus, build_corpus
from p2pdiloco.train.learner import Learner
from p2pdiloco.train.models import get_spec
from p2pdiloco.train.tokenizer import load_tokenizer


@dataclass
class MemNode:
    name: str
    identity: Identity
    runtime: NodeRuntime
    trainer: Trainer | None = None
    stopped: bool = False

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def version(self) -> int:
        return self.runtime.chain.version


class MemoryNetwork:
    def __init__(
        self,
        workdir: Path,
        nodes: int = 4,
        *,
        committee_size: int | None = None,
        inner_steps: int = 4,
        compression: str = "int8",
        aggregation: str = "trimmed_mean",
        rules: Mapping[str, Any] | None = None,
        attackers: Mapping[int, str] | None = None,
        learners: int | None = None,  # the first ``learners`` nodes train; all serve and sync
        seed: int = 0,
        time_budget: float | None = None,  # the manifest's seconds of training per delta
        slowdown: Mapping[int, float] | None = None,  # node index: each of its steps takes ×s
        islands: Mapping[int, int] | None = None,  # node index: an island of that many ranks
        # Share of wall time each trainer trains (join's --compute-share). A quarter: the
        # trainers share one process and its cores with every node's loop, and between rounds
        # they would only train on (three runtime tests: 105 CPU-s in 68 s at 1, 64 in 53).
        compute_share: float = 0.25,
        fragments: int = 1,  # Streaming DiLoCo fragments of the manifest (sync.fragments)
        # Steps per Train action; None: ``LearnerMachine.for_run``'s, as ``join`` trains (a
        # whole stretch when four does not divide it)
        chunk: int | None = 1,
        held_out: Mapping[str, Any] | None = None,  # the manifest's held-out split (ADR 0059)
        # The genesis committee: the first this many nodes (None: the first k); 0 names none,
        # and the creator (node 0) is the run's one founder, as ``run create`` makes it
        founders: int | None = None,
    ) -> None:
        self.workdir = workdir
        self.count = nodes
        self.k = committee_size or nodes
        self.inner_steps = inner_steps
        self.compression = compression
        self.rules = {
            "aggregation": aggregation,
            "grace": 5.0,
            "linger": 1.0,
            "agree_timeout": 2.0,
            **(rules or {}),
        }
        self.attackers = dict(attackers or {})
        self.learners = nodes if learners is None else learners
        self.seed = seed
        self.time_budget = time_budget
        self.slowdown = dict(slowdown or {})
        self.islands = dict(islands or {})
        self.compute_share = compute_share
        self.fragments = fragments
        self.chunk = chunk
        self.held_out = held_out
        self.founders = self.k if founders is None else founders
        self.hub = MemoryHub()
        self.directory = MemoryDirectory()
        self.nodes: list[MemNode] = []
        self.manifest: RunManifest | None = None
        self.run_id = ""
        self.corpus: PackedCorpus | None = None

    async def __aenter__(self) -> MemoryNetwork:
        ids = [Identity.generate() for _ in range(self.count)]
        self.run_id, self.manifest, _ = create_manifest(
            ids[0],
            name="memnet",
            model="gemma-tiny",
            data="embedded",
            seed=self.seed,
            inner_steps=self.inner_steps,
            time_budget=self.time_budget,
            committee_size=self.k,
            compression=self.compression,
            genesis_committee=[i.peer_id for i in ids[: self.founders]],
            inner={"batch_size": 2, "seq_len": 32, "warmup_steps": 2, "total_steps": 1000},
            outer={"fragments": self.fragments},
            rules=self.rules,
            **({} if self.held_out is None else {"held_out": dict(self.held_out)}),
        )
        loop = asyncio.get_running_loop()
        self.corpus = await loop.run_in_executor(None, _small_corpus)
        for i, ident in enumerate(ids):
            self.nodes.append(await self._start_node(f"n{i}", ident, train=i < self.learners))
        return self

    async def _start_node(self, name: str, identity: Identity, *, train: bool) -> MemNode:
        assert self.manifest is not None and self.corpus is not None
        me = identity.peer_id
        cfg = RuntimeConfig(
            state_dir=self.workdir / name, tick=0.05, heartbeat=0.1, poll=0.3, evaluate=False
        )
        runtime = NodeRuntime(
            identity,
            self.run_id,
            self.manifest,
            self.directory.plane(me),
            self.hub.transport(me),
            cfg,
            corpus=self.corpus,
        )
        state = await runtime.start()
        node = MemNode(name, identity, runtime)
        if train:
            index = next((i for i, n in enumerate(self.nodes) if n.name == name), len(self.nodes))
            attack = self.attackers.get(index)
            kw: dict[str, Any] = dict(
                attack=AttackConfig(attack) if attack else None, base_version=state.version
            )
            if self.islands.get(index, 1) > 1:  # rank 0 here, the members real processes
                from p2pdiloco.island.learner import IslandLearner
                from p2pdiloco.island.spec import IslandSpec

                spec = IslandSpec(("cpu",) * self.islands[index], threads=1, timeout_s=60)
                manifest, corpus = self.manifest, self.corpus  # narrowed above, for the lambda
                learner: Learner = await asyncio.get_running_loop().run_in_executor(
                    None,
                    lambda: IslandLearner(
                        manifest,
                        corpus,
                        me,
                        state.params,
                        spec=spec,
                        log_dir=self.workdir / name,
                        **kw,
                    ),
                )
            else:
                learner = Learner(
                    self.manifest, self.corpus, me, state.params, device=torch.device("cpu"), **kw
                )
            if self.slowdown.get(index, 1.0) > 1.0:
                _throttle(learner, self.slowdown[index])
            machine = LearnerMachine.for_run(
                self.manifest, state.version, inner_steps=self.inner_steps, chunk=self.chunk
            )
            node.trainer = Trainer(
                learner,
                machine,
                state,
                identity=identity,
                run_id=self.run_id,
                manifest=self.manifest,
                submit=runtime.submit,
                catch_up=runtime.request_version,
                replay=attack == "replay",
                inflate=attack == "inflate",
                compute_share=self.compute_share,
            )
            trainer = node.trainer
            await runtime.attach(trainer.deliver, lambda: trainer.view, state.version)
            trainer.start()
        return node

    async def restart(self, node: MemNode) -> MemNode:
        """Start ``node`` again from its state directory (after ``stop``)."""
        self.hub.down.discard(node.peer_id)
        self.directory.down.discard(node.peer_id)
        fresh = await self._start_node(node.name, node.identity, train=node.trainer is not None)
        self.nodes[self.nodes.index(node)] = fresh
        return fresh

    async def stop(self, node: MemNode) -> None:
        """The node vanishes: unreachable at once, its trainer and runtime stopped."""
        self.hub.down.add(node.peer_id)
        self.directory.down.add(node.peer_id)
        self.hub.handlers.pop(node.peer_id, None)
        node.stopped = True
        if node.trainer is not None:
            trainer = node.trainer
            await asyncio.get_running_loop().run_in_executor(None, trainer.stop, 30.0)
            await asyncio.get_running_loop().run_in_executor(None, trainer.learner.close)
        await node.runtime.close()

    async def __aexit__(self, *exc: object) -> None:
        # All at once: a test that failed on a wait_for then shows its error within one
        # trainer's stop time, not the sum of them.
        await asyncio.gather(*(self.stop(n) for n in self.nodes if not n.stopped))

    # -- observing -----------------------------------------------------------------------------

    def live(self) -> list[MemNode]:
        return [n for n in self.nodes if not n.stopped]

    def min_version(self) -> int:
        return min(n.version for n in self.live())

    async def wait_for(self, pred: Callable[[], bool], timeout: float, what: str = "") -> None:
        """Poll ``pred`` on the loop until true; TimeoutError naming ``what`` and the versions."""
        deadline = time.monotonic() + timeout
        while not pred():
            errors = [
                n.trainer.view.error for n in self.live() if n.trainer and n.trainer.view.error
            ]
            if errors:
                raise RuntimeError(f"a trainer failed: {errors[0]}")
            if time.monotonic() > deadline:
                versions = {n.name: n.version for n in self.nodes}
                raise TimeoutError(
                    f"not within {timeout:.0f} s: {what or pred}; versions {versions}"
                )
            await asyncio.sleep(0.05)


def _small_corpus() -> PackedCorpus:
    tokenizer = load_tokenizer(get_spec("gemma-tiny").tokenizer)
    return build_corpus("embedded", tokenizer, seq_len=32, max_bytes=2**20)


def _throttle(learner: Learner, factor: float) -> None:
    """Make each of ``learner``'s steps take ``factor`` times as long (a slower island): after
    every chunk, sleep (factor − 1) × the chunk's time."""
    train = learner.train

    def slow(steps: int, version: int | None = None):  # type: ignore[no-untyped-def]
        start = time.monotonic()
        out = train(steps, version)
        time.sleep((factor - 1.0) * (time.monotonic() - start))
        return out

    learner.train = slow  # type: ignore[method-assign]
