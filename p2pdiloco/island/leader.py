"""Rank 0 of an island: it starts the members, hosts the command channel, and re-forms the
island when one is lost.

``Island.call`` posts a command and runs rank 0's part of it. A collective that fails because
a member stopped raises ``IslandBroken``; ``reform`` then forms the next generation from the
members still running (the process group of the old one is torn down, the survivors join a
new one under a new key space, with their new ranks) and rank 0 loads a state into it: the
work of the broken stretch is gone, nothing certified is touched.
"""

from __future__ import annotations

import datetime
import logging
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from p2pdiloco.island import channel
from p2pdiloco.island.sealed import IslandAuthError, SealedStore
from p2pdiloco.island.secret import new_secret
from p2pdiloco.island.shards import Shards
from p2pdiloco.island.spec import IslandSpec
from p2pdiloco.train.configs import InnerConfig

log = logging.getLogger(__name__)


class IslandBroken(RuntimeError):
    """A member of the island stopped mid-command: the island must re-form."""


BEAT_WINDOW = 1.5  # seconds: a member whose beat counter did not move in this long is gone


def _gist(e: BaseException) -> str:
    """The first sentence of a backend's error, without its source location prefix."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().splitlines()[0] if str(e) else "")
    return text.split(". ")[0][:120] or type(e).__name__


def generation_ranks(alive: list[int], batch_size: int) -> dict[str, int]:
    """Member id → rank for a generation: rank 0, then the running members in id order, as
    many as keep the run's step batch splitting evenly over the ranks (the rest sit out)."""
    world = max(w for w in range(1, len(alive) + 2) if batch_size % w == 0)
    return {"0": 0, **{str(i): r + 1 for r, i in enumerate(alive[: world - 1])}}


class Island:
    def __init__(
        self,
        spec: IslandSpec,
        model: str,
        seed: int,
        cfg: InnerConfig,
        *,
        log_dir: Path,
        micro_batch: int | None = None,
    ) -> None:
        if spec.ranks < 2 and not spec.lan:
            raise ValueError("an island has at least 2 ranks (or is open to its LAN)")
        self.spec, self.model, self.seed, self.cfg = spec, model, seed, cfg
        self.micro_batch = micro_batch
        self.device = torch.device(spec.devices[0])
        self.raw_store = dist.TCPStore(
            "0.0.0.0" if spec.lan else "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
        self.secret = spec.secret or new_secret()
        self.store = SealedStore(self.raw_store, self.secret)
        # Where members reach the store: other hosts at ``spec.host``, children on loopback.
        self.address = f"{spec.host if spec.lan else '127.0.0.1'}:{self.raw_store.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.members: dict[int, subprocess.Popen[bytes]] = {}  # this host's, by member id
        for r in range(1, spec.ranks):
            i = self.store.add(channel.MEMBERS, 1)
            cmd = [
                sys.executable,
                "-m",
                "p2pdiloco.island.member",
                f"--store=127.0.0.1:{self.raw_store.port}",
                f"--id={i}",
                f"--device={spec.devices[r]}",
                "--secret-stdin",
            ]
            if spec.threads:
                cmd.append(f"--threads={spec.threads}")
            with open(log_dir / f"island-member-{i}.log", "ab") as out:
                child = subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT
                )
            assert child.stdin is not None
            child.stdin.write(self.secret.hex().encode() + b"\n")  # never in argv or environ
            child.stdin.close()
            self.members[i] = child
        self.gen, self.seq = -1, 0
        self.in_gen: list[int] = []  # member ids of the current generation
        self.seen = 0  # members registered when it formed
        self.shards: Shards | None = None
        self.admitted: set[int] = set()  # other hosts' members whose registration verified
        self.refused = 0  # registrations that failed the check

    @property
    def world(self) -> int:
        return self.shards.world if self.shards is not None else 0

    def alive(self) -> list[int]:
        """Members running now: this host's children that have not exited, and other hosts'
        admitted members (``admit``) whose sealed beat moved on within ``BEAT_WINDOW`` s."""
        local = {i for i, p in self.members.items() if p.poll() is None}
        remote = self.admit()
        if remote:
            before = {i: self._beat(i) for i in remote}
            time.sleep(BEAT_WINDOW)
            remote = [i for i in remote if self._beat(i) > before[i]]
        return sorted(local | set(remote))

    def admit(self) -> list[int]:
        """Other hosts' members whose registration (their id, pushed to the join queue) is
        sealed with this island's secret. One that is not is refused and logged: the queue is
        read ``JOINS_PER_LOOK`` entries at a time, so a flood of junk costs reads, not memory
        or a place in the island."""
        for entry in self.store.pop_all(channel.JOIN, channel.JOINS_PER_LOOK):
            if isinstance(entry, IslandAuthError):
                self.refused += 1
                if math.log10(self.refused).is_integer():  # the 1st, 10th, 100th, ...
                    log.warning(
                        "island: refused a member: its registration is not sealed with this "
                        "island's secret (reason: island_auth_failed; %d refused so far)",
                        self.refused,
                    )
                continue
            try:
                member = int(entry)
            except ValueError:
                continue  # sealed by a holder of the secret: a bug, not an attack
            if member not in self.members:
                self.admitted.add(member)
        return sorted(self.admitted)

    def newcomers(self) -> bool:
        """Members have been admitted since this generation formed (LAN hosts joining):
        forming the next one at a send boundary takes them in without losing a step."""
        return len(self.admit()) > self.seen

    def _beat(self, member: int) -> int:
        """The member's last sealed beat; -1 if it has none that verifies."""
        key = channel.beat_key(member)
        try:
            return int(self.store.get(key)) if self.store.check([key]) else -1
        except (IslandAuthError, ValueError):
            return -1

    def form(self, global_step: int) -> Shards:
        """Form the next generation from rank 0 and every member still running."""
        self.gen, self.seq = self.gen + 1, 0
        self.seen = len(self.admit())
        ranks = generation_ranks(self.alive(), self.cfg.batch_size)
        self.in_gen = [int(i) for i in ranks if i != "0"]
        channel.put(
            self.store,
            channel.gen_key(self.gen),
            channel.plan(
                ranks,
                self.model,
                self.seed,
                self.cfg,
                global_step,
                self.spec.backend,
                self.spec.timeout_s,
                self.micro_batch,
                self.spec.checkpointing,
                self.spec.offload,
            ),
        )
        self.store.add(channel.GENS, 1)
        dist.init_process_group(
            self.spec.backend,
            store=channel.pg_store(self.store, self.gen),
            rank=0,
            world_size=len(ranks),
            timeout=datetime.timedelta(seconds=self.spec.timeout_s),
        )
        log.info("island generation %d: %d ranks", self.gen, len(ranks))
        self.shards = Shards(
            self.model,
            self.seed,
            self.cfg,
            global_step=global_step,
            device=self.device,
            micro_batch=self.micro_batch,
            checkpointing=self.spec.checkpointing,
            offload=self.spec.offload,
        )
        return self.shards

    def call(self, op: str, full: Any = None, **args: Any) -> Any:
        """Post ``op`` to the members and run rank 0's part; ``IslandBroken`` if a member
        stopped (a non-finite loss, FloatingPointError, is every rank's and passes through)."""
        assert self.shards is not None, "form the island first"
        cmd = {"op": op, **args}
        self._post(cmd)
        try:
            return channel.run_op(self.shards, cmd, full)
        except FloatingPointError:
            raise
        except (RuntimeError, dist.DistError) as e:
            lost = self._lost_members(grace=2.0)
            if lost or isinstance(e, dist.DistError):
                raise IslandBroken(
                    f"island member {lost or '?'} stopped during {op!r} ({_gist(e)})"
                ) from e
            raise

    def reform(self, global_step: int) -> Shards:
        """Tear the broken generation down and form the next from the survivors."""
        self._end_generation("reform")
        return self.form(global_step)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every member (they exit on 'stop'); kill what is left after ``timeout``."""
        if self.shards is not None:
            self._end_generation("stop")
        deadline = time.monotonic() + timeout
        for p in self.members.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _end_generation(self, how: str) -> None:
        self._post({"op": how})  # members waiting for a command read it and leave
        self.shards = None
        try:
            dist.destroy_process_group()
        except Exception as e:  # a broken group may fail to tear down: it is gone either way
            log.info("island process group teardown: %s", e)

    def _post(self, cmd: dict[str, Any]) -> None:
        channel.put(self.store, channel.cmd_key(self.gen, self.seq), cmd)
        if self.seq >= 2:  # every rank finished command seq - 1's collective before this one
            self.store.delete_key(channel.cmd_key(self.gen, self.seq - 2))
        self.seq += 1

    def _lost_members(self, grace: float) -> list[int]:
        """Members that exited, waiting up to ``grace`` s for a dying one to be reaped."""
        deadline = time.monotonic() + grace
        while True:
            lost = sorted(set(self.in_gen) - set(self.alive()))
            if lost or time.monotonic() > deadline:
                return lost
            time.sleep(0.05)

    def __del__(self) -> None:  # never leave members behind, even on an error path
        for p in getattr(self, "members", {}).values():
            if p.poll() is None:
                p.kill()
