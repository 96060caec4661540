"""The records plane: a hivemind DHT node that stores and reads signed envelopes.

hivemind runs the DHT in a child process with its own p2pd daemon; this wrapper only speaks
bytes in and out. Every value read back is an untrusted envelope: ``read`` verifies each one
(size before parse, schema, signature, subkey == signer) and drops the bad ones with one log line
naming the sender, so a peer can never make this node crash or act on a forged record.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import multiprocessing as mp
import os
import re
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.serializer import MSGPackSerializer
from multiaddr import Multiaddr

from p2pdiloco.aio import quiet_cancelled_stream_callbacks
from p2pdiloco.errors import UserError
from p2pdiloco.net import lifeline
from p2pdiloco.net.record_rules import RecordRefused, RejectionLog, check_record
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.signing import Envelope, InvalidRecord, open_envelope
from p2pdiloco.signals import ignore_interrupts, interrupts_held

log = logging.getLogger(__name__)

# How long a DHT process may take to say it is ready (p2pd started, initial peers answered or
# refused; seconds under load), and how many fresh processes a start tries before it fails.
START_TIMEOUT = 90.0
START_ATTEMPTS = 2

# Largest value this node stores for anyone, or accepts when reading: manifests and heartbeats
# are a few KiB; anything bigger is an attack or a bug.
MAX_RECORD_BYTES = 16 * 1024
# Most (key, subkey) slots one signer may occupy in this node's storage.
MAX_SLOTS_PER_SIGNER = 64


def _dht_key(key: str) -> bytes:
    """The DHT id bytes hivemind stores a plain key under (what the validator is handed)."""
    return bytes(DHTID.generate(source=key).to_bytes())


class NetworkError(UserError):
    """The network plane cannot start or reach anyone (one-line message)."""


@dataclass(frozen=True)
class StoredRecord:
    subkey: str
    envelope: Envelope
    expiration: float


class EnvelopeValidator(RecordValidatorBase):
    """Refuses to store, or to return from a lookup, anything but a signed envelope that belongs
    in its slot.

    Runs inside the DHT process for every incoming STORE and every value found by GET. It caps
    the record size and the number of slots one signer may fill, so no peer can make a bootstrap
    server store unbounded data, and applies ``record_rules.check_record``: the record's kind,
    key, subkey, signer, signed time and expiry must agree with what it says (no squatted
    manifest slot, no replayed heartbeat with a 10-year expiry). Refusals are logged at most once
    a minute per (signer, reason code).
    """

    def __init__(self, max_bytes: int = MAX_RECORD_BYTES, max_slots: int = MAX_SLOTS_PER_SIGNER):
        self.max_bytes = max_bytes
        self.max_slots = max_slots
        self._slots: dict[str, set[tuple[bytes, bytes]]] = {}
        self.rejections = RejectionLog()

    def validate(self, record: DHTRecord) -> bool:
        try:
            self.check(record)
        except RecordRefused as e:
            self.rejections.warn("DHT record", e.signer, e.code, str(e))
            return False
        return True

    def check(self, record: DHTRecord, now: float | None = None) -> Envelope:
        """The record's envelope; RecordRefused (with ``signer`` set when known) otherwise."""
        if len(record.value) > self.max_bytes + 64:
            raise RecordRefused(Reason.MALFORMED, f"{len(record.value)} bytes is over the limit")
        try:
            raw = MSGPackSerializer.loads(record.value)
            # time is check_record's (code BAD_TIMESTAMP), not a signature failure
            env = open_envelope(raw, max_bytes=self.max_bytes, max_skew=math.inf)
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
        except InvalidRecord as e:
            raise RecordRefused(Reason.INVALID_SIGNATURE, str(e), e.signer) from None
        except Exception as e:  # undecodable msgpack from a peer
            raise RecordRefused(Reason.MALFORMED, f"undecodable ({type(e).__name__})") from None
        check_record(env, record.key, subkey, record.expiration_time, key_id=_dht_key, now=now)
        slots = self._slots.setdefault(env.signer, set())
        slot = (record.key, record.subkey)
        if slot not in slots:
            if len(slots) >= self.max_slots:
                raise RecordRefused(Reason.OVER_QUOTA, f"over {self.max_slots} slots", env.signer)
            slots.add(slot)
        return env

    @property
    def priority(self) -> int:
        return 0

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


async def _rejoin(_dht: hivemind.DHT, node: DHTNode, maddrs: list[str], timeout: float) -> int:
    """Runs inside the DHT process (see DHT.run_coroutine)."""
    answered = 0
    for maddr in maddrs:
        try:
            peer = PeerID.from_base58(Multiaddr(maddr)["p2p"])
            if peer in node.protocol.routing_table:
                answered += 1
                continue
            await asyncio.wait_for(node.p2p._client.connect(peer, [Multiaddr(maddr)]), timeout)
            if await asyncio.wait_for(node.protocol.call_ping(peer), timeout) is not None:
                answered += 1
        except Exception as e:  # an unreachable bootstrap is expected; try again next interval
            log.debug("rejoin via %s failed: %s", maddr, e)
    return answered


def _unpoison_mpfuture_locks(wait: float = 2.0) -> None:
    """hivemind's MPFuture guards its pipes with two process-shared locks made at import
    (``mp.Lock`` class attributes), inherited by every process forked after it. A process
    killed while holding one (a DHT process ended with SIGKILL mid-update) leaves it held for
    good, and every DHT process forked later blocks on it before it can say it is ready: a
    start that never ends (a fresh-clone CI saw every DHT start of one test worker hang so,
    py-spy on the child: ``MPFuture._send_update`` in ``SemLock.__enter__``). Before forking a
    DHT process, a lock nobody releases within ``wait`` seconds (each is held for one pipe
    write) is replaced by a fresh one, which the children forked from here on share."""
    for name in ("_update_lock", "_initialization_lock"):
        lock = getattr(MPFuture, name)
        if lock.acquire(timeout=wait):
            lock.release()
            continue
        setattr(MPFuture, name, mp.Lock())
        log.warning("hivemind's MPFuture.%s was held by a process that is gone: replaced", name)


def _process_state(pid: int | None) -> str:
    """What a process is doing, from /proc: its state and what each thread waits in (wchan),
    or how it ended; for a start that never finished."""
    if pid is None:
        return "not started"
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        state = next(
            (ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("State:")),
            "?",
        )
        waits = sorted(
            {(t / "wchan").read_text().strip() or "-" for t in Path(f"/proc/{pid}/task").iterdir()}
        )
    except OSError:
        return f"process {pid} gone"
    return f"process {pid} {state}, threads waiting in {', '.join(waits)}"


def _start_failure(e: Exception, initial_peers: Sequence[str]) -> str:
    """One line for a DHT that did not start: what was tried and what to check, without the
    daemon's own wording (``Daemon failed to start: <date> <time> ...``)."""
    tried = ", ".join(initial_peers) or "none"
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if "failed to connect to bootstrap peers" in text:
        return (
            f"cannot join the DHT: no bootstrap server answered (tried: {tried}); check that "
            "the server is running at that address and that the peer id after /p2p/ is the one "
            "it printed at start (a restarted server keeps it only with the same --identity key)"
        )
    why = re.sub(r"^Daemon failed to start:\s*(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s*)?", "", text)
    return f"cannot start the DHT node (bootstrap servers tried: {tried}): {why}"


def parent_gone(parent: int, wait: float = 1.0) -> bool:
    """In a child: True once ``parent`` is no longer its parent, within ``wait`` seconds (a
    parent killed outright closes its pipes before the child is handed to another parent)."""
    deadline = time.monotonic() + wait
    while os.getppid() == parent:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)  # the kernel's reparenting, a few milliseconds at most
    return True


class _GuardedDHT(hivemind.DHT):
    """hivemind's DHT process, and its p2pd, die with the process that started them (ADR 0011),
    and never hear the terminal's Ctrl-C: stopping them is the node's part of its clean stop.

    The DHT process watches its parent; the parent's reaper watches the DHT process's tree.
    hivemind ignores SIGINT in the DHT process, but p2pd starts with every signal at its
    default (libuv resets them) and shuts down on SIGINT: a Ctrl-C during a node's start made
    the DHT fail ("Daemon failed to start: None"), and at a stop left it to hivemind's hard
    way. So the DHT process leaves the terminal's process group, p2pd with it.
    """

    def __init__(self, **kwargs: Any) -> None:
        self._lifeline_parent = os.getpid()  # before super() starts the process
        quiet_cancelled_stream_callbacks()  # here and in the DHT process forked from here
        _unpoison_mpfuture_locks()  # before the first MPFuture here, and the fork in start()
        # hivemind makes its first MPFuture here: that starts its reader thread and, for the
        # future's shared byte, torch's shm manager (hivemind sets the file_system strategy), a
        # child in this process group until it calls setsid. A Ctrl-C that killed the manager
        # there left this thread spinning in torch's start_manager, the GIL held, the handler
        # never run. Both start with SIGINT blocked and keep it (the reader thread then never
        # takes a Ctrl-C meant for this one); one that comes meanwhile is raised here after.
        with interrupts_held():
            super().__init__(**kwargs)

    def start(self) -> None:
        with interrupts_held():  # until the child ignores SIGINT (``run``)
            super().start()
        lifeline.guard(self.pid)

    def run(self) -> None:
        ignore_interrupts()
        os.setpgid(0, 0)
        # In a background group a write to the terminal would stop the process (stty tostop);
        # one that ignores SIGTTOU may write.
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        lifeline.watch_parent(self._lifeline_parent)
        try:
            super().run()
        except (ConnectionError, EOFError):
            if not parent_gone(self._lifeline_parent):
                raise
            # The node died (SIGKILL) mid-call and its end of the pipe broke: nobody is left to
            # report to, and a traceback here reads as this process failing. End as the
            # lifeline would have a moment later.
            lifeline.kill_all(lifeline.descendants([os.getpid()]))
            os._exit(1)


class DHTPlane:
    """One hivemind DHT node bound to a node identity.

    Use as a context manager. ``initial_peers`` are bootstrap multiaddrs; with none, this node
    starts a new DHT (what a bootstrap server does). Raises NetworkError if the daemon cannot
    start, or if no initial peer could be reached.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        initial_peers: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        announce: Sequence[str] = (),
        client_mode: bool = False,
        relay_service: bool = False,
        force_public: bool = False,
        identity_path: Path | None = None,
    ) -> None:
        self.identity = identity
        self.rejections = RejectionLog()  # records dropped when read, logged once a minute
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        if identity_path is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="p2pdiloco-id-")
            identity_path = Path(self._tmpdir.name) / "identity.key"
            identity.save(identity_path)
        ip = "ip6" if ":" in host else "ip4"
        kwargs: dict[str, Any] = dict(
            host_maddrs=[f"/{ip}/{host}/tcp/{port}"],
            identity_path=str(identity_path),
            client_mode=client_mode,
            use_relay=True,
            use_auto_relay=not relay_service and not client_mode,
        )
        if announce:
            kwargs["announce_maddrs"] = list(announce)
        if force_public:
            kwargs["force_reachability"] = "public"
        for attempt in range(START_ATTEMPTS):
            try:
                self.dht = _GuardedDHT(
                    initial_peers=list(initial_peers) or None,
                    start=False,
                    record_validators=[EnvelopeValidator()],
                    # A returning peer with the same key would otherwise wait for a dial timeout.
                    check_if_identity_free=False,
                    **kwargs,
                )
                self.dht.run_in_background(await_ready=True, timeout=START_TIMEOUT)
                break
            except TimeoutError as e:
                # The DHT process never said it is ready (a fresh-clone CI saw starts hang for good
                # in a long-lived test worker): say what it was doing, end it, start afresh.
                state = _process_state(self.dht.pid)
                self._kill()
                if attempt + 1 < START_ATTEMPTS:
                    log.warning(
                        "the DHT process did not start within %.0f s (%s); starting it again",
                        START_TIMEOUT,
                        state,
                    )
                    continue
                self._cleanup_tmp()
                text = f"the DHT process did not start within {START_TIMEOUT:.0f} s ({state})"
                raise NetworkError(_start_failure(RuntimeError(text), initial_peers)) from e
            except BaseException as e:  # failed, or interrupted (Ctrl-C while starting)
                self._kill()
                self._cleanup_tmp()
                if not isinstance(e, Exception):
                    raise
                raise NetworkError(_start_failure(e, initial_peers)) from e
        if str(self.dht.peer_id) != identity.peer_id:
            self.close()
            raise NetworkError("the DHT daemon did not take this node's identity key")

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/<peer id>) others can use to reach this node's DHT."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def store(self, key: str, subkey: str, raw: bytes, ttl: float) -> bool:
        """Store one envelope under (key, subkey) for ``ttl`` seconds; False if no peer took it."""
        expiration = get_dht_time() + ttl
        return bool(self.dht.store(key, raw, expiration_time=expiration, subkey=subkey))

    def read(
        self, key: str, *, kind: str, run_id: str | None = None, latest: bool = True
    ) -> Iterator[StoredRecord]:
        """Valid envelopes under ``key``; invalid ones are logged (with the sender) and skipped."""
        found = self.dht.get(key, latest=latest)
        if found is None or not isinstance(found.value, dict):
            return
        for subkey, item in found.value.items():
            raw, expiration = item.value, item.expiration_time
            try:
                if not isinstance(raw, bytes):
                    raise InvalidRecord(f"value under subkey {str(subkey)[:64]!r} is not bytes")
                env = open_envelope(
                    raw, kind=kind, run_id=run_id, max_bytes=MAX_RECORD_BYTES, max_skew=math.inf
                )
                # The same rules as at store time: a peer running an older validator may hold
                # a squatted or replayed record.
                check_record(env, key, subkey, float(expiration))
            except InvalidRecord as e:
                sender = e.signer or str(subkey)[:64]
                self.rejections.warn(f"{kind} record", sender, Reason.INVALID_SIGNATURE, str(e))
                continue
            except RecordRefused as e:
                self.rejections.warn(f"{kind} record", e.signer, e.code, str(e))
                continue
            yield StoredRecord(str(subkey), env, float(expiration))

    def rejoin(self, initial_peers: Sequence[str], timeout: float = 10.0) -> int:
        """Re-dial and ping bootstrap peers missing from the routing table; how many answered.

        hivemind pings ``initial_peers`` only once, at start. A bootstrap that restarts drops out
        of our routing table, and a node whose only contact it was would stay isolated; calling
        this every heartbeat interval heals that within one interval of the bootstrap's return.
        """
        return int(
            self.dht.run_coroutine(
                functools.partial(_rejoin, maddrs=list(initial_peers), timeout=timeout)
            )
        )

    def close(self) -> None:
        """Stop the DHT process and its daemon (idempotent); whatever of them is left after
        hivemind's shutdown (its hard way ends the DHT process, not p2pd) is killed."""
        dht = getattr(self, "dht", None)
        if dht is not None and dht.is_alive():
            tree = lifeline.descendants([dht.pid])
            dht.shutdown()
            lifeline.kill_all(tree)
        self._cleanup_tmp()

    def _kill(self) -> None:
        """A DHT process that failed or was interrupted while starting holds nothing to save:
        it and its daemon are ended at once (SIGTERM, then SIGKILL)."""
        dht = getattr(self, "dht", None)
        if dht is None or dht.pid is None:
            return
        me = lifeline.identify(dht.pid)
        lifeline.kill_all(lifeline.descendants([dht.pid]) | ({me} if me is not None else set()))
        dht.join(timeout=1.0)

    def _cleanup_tmp(self) -> None:
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> DHTPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
