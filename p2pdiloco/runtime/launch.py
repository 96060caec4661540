"""Wiring a joined ``Node`` into a running node: the runtime on the P2P loop, the trainer thread.

``RunningNode.start`` builds the corpus, starts the ``NodeRuntime`` on the node's P2P loop
(restoring or downloading the certified state), then the training thread from that state,
restoring local progress saved by a previous graceful stop. ``stop`` stops the trainer after
its current chunk, saves local progress next to the certified state, and closes the runtime.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.core.learner import LearnerMachine
from p2pdiloco.island.spec import IslandSpec
from p2pdiloco.net.plane import Presence
from p2pdiloco.net.transport import P2PTransport
from p2pdiloco.node import Node
from p2pdiloco.runtime.node_runtime import NodeRuntime, RuntimeConfig
from p2pdiloco.runtime.status import RuntimeView
from p2pdiloco.runtime.trainer import Trainer, TrainerView
from p2pdiloco.sync.rules import check_supported
from p2pdiloco.train.attacks import AttackConfig
from p2pdiloco.train.checkpoint import atomic_write_bytes
from p2pdiloco.train.data import build_corpus, eval_fraction_of
from p2pdiloco.train.device import resolve_device
from p2pdiloco.train.learner import Learner
from p2pdiloco.train.local_state import load_local, restore_local, save_local
from p2pdiloco.train.models import get_spec
from p2pdiloco.train.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """How this node trains (the run's rules come from its signed manifest)."""

    state_dir: Path
    device: str = "auto"
    threads: int | None = None  # torch intra-op threads; None: torch's default
    compute_share: float = 1.0  # share of wall time spent training (join --compute-share)
    until_version: int | None = None  # stop training once this version is applied; keep serving
    attack: str | None = None  # play an attacker (demo and tests only)
    max_data_bytes: int = 16 * 2**20
    micro_batch: int | None = None  # sequences per forward pass; None: the whole step batch
    train: bool = True  # False: membership only (heartbeats; no state, no learner)
    island: IslandSpec | None = None  # several processes train this node's learner (FSDP2)
    runtime: RuntimeConfig | None = field(default=None)


class RunningNode:
    def __init__(self, node: Node, cfg: TrainConfig) -> None:
        assert node.run is not None and node.bridge is not None
        check_supported(node.run.manifest)  # one clear line if this build cannot honour it
        self.node = node
        self.cfg = cfg
        self.run_id = node.run.run_id
        self.manifest = node.run.manifest
        self.me = node.identity.peer_id
        self.runtime: NodeRuntime | None = None
        self.trainer: Trainer | None = None
        self._membership: asyncio.Task[None] | None = None

    def start(self) -> int:
        """Start everything; the certified version training starts from."""
        cfg, node = self.cfg, self.node
        assert node.run is not None and node.bridge is not None
        if not cfg.train:
            self._membership = node.bridge.run(_start_ticking(node), 10)
            return 0
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        spec = get_spec(self.manifest.model)
        corpus = build_corpus(
            self.manifest.data,
            load_tokenizer(spec.tokenizer),
            seq_len=self.manifest.inner.seq_len,
            max_bytes=cfg.max_data_bytes,
            eval_fraction=eval_fraction_of(self.manifest),
        )
        if node.run.raw:  # for offline leaderboards
            atomic_write_bytes(cfg.state_dir / "manifest.json", node.run.raw)
        bridge = node.bridge
        transport = P2PTransport(bridge.p2p, self.me, node.peer_addrs)
        rcfg = cfg.runtime or RuntimeConfig(
            state_dir=cfg.state_dir, heartbeat=node.cfg.heartbeat_interval
        )
        self.runtime = NodeRuntime(
            node.identity, self.run_id, self.manifest, node, transport, rcfg, corpus=corpus
        )
        state = bridge.run(self.runtime.start(), 900)
        learner = self._learner(corpus, state.params, state.version)
        machine = LearnerMachine.for_run(self.manifest, state.version, stop_at=cfg.until_version)
        local = load_local(cfg.state_dir, self.run_id)
        same_base = local is not None and int(local.get("base_version", -1)) == state.version
        if local is not None and same_base and restore_local(learner, local):
            machine.trained = learner.steps_since_send
            log.info(
                "resumed local progress: %d steps on version %d",
                learner.steps_since_send,
                state.version,
            )
        runtime = self.runtime
        self.trainer = Trainer(
            learner,
            machine,
            state,
            identity=node.identity,
            run_id=self.run_id,
            manifest=self.manifest,
            submit=runtime.submit,
            catch_up=runtime.request_version,
            replay=cfg.attack == "replay",
            inflate=cfg.attack == "inflate",
            compute_share=cfg.compute_share,
        )
        trainer = self.trainer
        bridge.run(runtime.attach(trainer.deliver, lambda: trainer.view, state.version), 30)
        trainer.start()
        return state.version

    def _learner(self, corpus: Any, params: Any, version: int) -> Learner:
        """This node's learner: one process on ``cfg.device``, or rank 0 of an island."""
        cfg = self.cfg
        kw: dict[str, Any] = dict(
            attack=AttackConfig(cfg.attack) if cfg.attack else None,
            base_version=version,
            micro_batch=cfg.micro_batch,
        )
        if cfg.island is None:
            return Learner(
                self.manifest, corpus, self.me, params, device=resolve_device(cfg.device), **kw
            )
        from p2pdiloco.island.learner import IslandLearner

        learner = IslandLearner(
            self.manifest, corpus, self.me, params, spec=cfg.island, log_dir=cfg.state_dir, **kw
        )
        log.info("island of %d ranks (%s) formed", learner.world, cfg.island.backend)
        return learner

    def stop(self, timeout: float = 60.0) -> str:
        """Stop after the current chunk of steps (an in-flight delta is abandoned), save the
        local progress next to the certified state, and say what was kept.

        Order: the trainer stops, the runtime closes (no version applies after this; workers
        finish their checkpoint writes), then the trainer settles onto the runtime's current
        version, so the saved progress and the saved certified state always match."""
        trainer, runtime, bridge = self.trainer, self.runtime, self.node.bridge
        if trainer is not None:
            trainer.stop(timeout)
        if bridge is not None:
            if self._membership is not None:
                bridge.loop.call_soon_threadsafe(self._membership.cancel)
            try:
                if runtime is not None:
                    bridge.run(runtime.close(), 10)
                # Let hashing, merging and checkpoint writes in the loop's workers finish (DHT
                # I/O runs in daemon threads and cannot hold the exit).
                bridge.run(bridge.loop.shutdown_default_executor(), 30)
            except Exception as e:  # shutting down: say it, keep going
                log.info("runtime close: %s", e)
        version = runtime.chain.saved if runtime is not None else 0
        kept = f"certified version {version} under {self.cfg.state_dir}"
        if trainer is not None and not trainer.alive and runtime is not None:
            trainer.settle(runtime.chain.current)
            try:
                save_local(self.cfg.state_dir, trainer.learner, self.run_id, trainer.state.version)
            except OSError as e:  # disk full or read-only: the certified files stay intact
                kept += f"; local progress not saved ({e.strerror or e})"
            else:
                kept += f", plus {trainer.learner.steps_since_send} local steps not yet merged"
        if trainer is not None and not trainer.alive:
            trainer.learner.close()  # an island's members stop with it
        if runtime is not None:
            runtime.write_final_status()
        return kept

    @property
    def error(self) -> str | None:
        """Why this node cannot go on (one line): a failed checkpoint write, or the trainer's
        error; None while all is well."""
        if self.runtime is not None and self.runtime.chain.failure is not None:
            return self.runtime.chain.failure
        return self.trainer.view.error if self.trainer is not None else None

    @property
    def alive(self) -> bool:
        return self.trainer is not None and self.trainer.alive

    def views(self) -> tuple[RuntimeView, TrainerView | None]:
        rv = self.runtime.view if self.runtime is not None else RuntimeView()
        return rv, self.trainer.view if self.trainer is not None else None


async def _start_ticking(node: Node) -> asyncio.Task[None]:
    """Membership only: tick the node's plane every heartbeat interval on this loop."""

    async def tick_forever() -> None:
        while True:
            await asyncio.sleep(node.cfg.heartbeat_interval)
            try:
                await node.tick(Presence(0, ("learner",), 0.0))
            except Exception:  # a failing interval is logged and retried, never fatal
                log.exception("heartbeat interval failed")

    return asyncio.create_task(tick_forever())
