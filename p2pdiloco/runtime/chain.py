"""The certified chain a node holds: certificates, the current and previous states, the disk.

Owned by the runtime's loop. On disk, under ``state_dir``: ``certified/`` (the newest certified
states, atomic checkpoints with their certificate), ``certs/<version>.json`` (every certificate
applied: this node's receipts, verified again from genesis by the ledger),
``updates/<version>.bin`` (the certified update of each saved state, when this node had it) and
``manifest.json``. A restart resumes from the newest checkpoint whose hash matches its
certificate, with its update when that matches the certificate's ``update_hash``, so a
restarted node still serves the update to peers one version behind. The chain also answers
peers' ``cert``, ``index``, ``chunk`` and ``update`` requests (the update of each of the two
states held, when this node has it: ADR 0029).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from p2pdiloco.net.sync_rpc import RpcRefused
from p2pdiloco.protocol.certificates import (
    Certificate,
    RosterEntry,
    parse_certificate,
    roster_digest,
)
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.sync.update import UPDATE_CHUNK_BYTES, hash_update
from p2pdiloco.train.checkpoint import CheckpointError, CheckpointStore, atomic_write_bytes

log = logging.getLogger(__name__)


class ChainStore:
    def __init__(self, state_dir: Path, run_id: str, keep: int = 2) -> None:
        self.dir = state_dir
        self.run_id = run_id
        (state_dir / "certs").mkdir(parents=True, exist_ok=True)
        self.store = CheckpointStore(state_dir / "certified", keep=keep)
        self.certs: dict[int, bytes] = {}  # version → certificate bytes held
        self.current: CertifiedState | None = None
        self.previous: CertifiedState | None = None  # still served while peers catch up
        self.saved = 0  # newest version on disk (restored or persisted); 0: genesis only
        # Set once, by a failed write (disk full, read-only): one line saying what was kept.
        self.failure: str | None = None
        for path in sorted((state_dir / "certs").glob("*.json")):
            if path.stem.isdigit():
                self.certs[int(path.stem)] = path.read_bytes()

    @property
    def version(self) -> int:
        return self.current.version if self.current is not None else 0

    @property
    def cert(self) -> Certificate | None:
        return self.current.cert if self.current is not None else None

    def install(self, state: CertifiedState) -> bool:
        """Make ``state`` current if it is newer; False otherwise."""
        if self.current is not None and state.version <= self.current.version:
            return False
        if state.cert is not None:
            self.certs[state.version] = state.cert.raw
        self.previous, self.current = self.current, state
        return True

    def complete(self, state: CertifiedState) -> None:
        """Hold ``state`` (with its committee state: ADR 0064) in place of the held state of
        its version, whose parameters alone were held."""
        if self.current is not None and self.current.version == state.version:
            self.current = state
        elif self.previous is not None and self.previous.version == state.version:
            self.previous = state

    def add_certs(self, chain: list[Certificate]) -> None:
        for c in chain:
            self.certs[c.body.version] = c.raw

    # -- disk (call from a worker thread: it writes and fsyncs) --------------------------------

    def persist(self, chain: list[Certificate], state: CertifiedState) -> None:
        """Write the chain's certificates, then the state with its certificate, atomically.

        A failed write (disk full, read-only, gone) is not raised: it is logged and kept in
        ``failure`` as one line, and the node's owner should stop it. Files already on disk
        stay intact (every write is atomic); the state stays served from memory meanwhile.
        """
        assert state.cert is not None
        tensors = state.tensors()
        try:
            for c in chain:
                atomic_write_bytes(self.dir / "certs" / f"{c.body.version:08d}.json", c.raw)
            if state.update is not None:  # before the state: a saved state finds its update
                self._save_update(state.version, bytes(state.update))
            self.store.save(tensors, self._meta(state.cert))
        except OSError as e:
            size = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30
            kept = f"version {self.saved}" if self.saved else "no version (genesis only)"
            self.failure = self.failure or (
                f"cannot save certified version {state.version} under {self.dir}: "
                f"{e.strerror or e}; {kept} stays saved there; free space (a state needs "
                f"{size:.2f} GiB, and {self.store.keep + 1} fit at once while one is written) "
                "or join again with --state-dir on a larger disk"
            )
            log.error("cannot save certified version %d: %s", state.version, e.strerror or e)
            return
        self.saved = state.version

    def _meta(self, cert: Certificate) -> dict[str, Any]:
        """What a checkpoint keeps beside the tensors: the certificate and its derived roster
        (ADR 0044), so a restart resumes the chain without walking it from genesis."""
        assert cert.roster is not None, "persist a certificate verified against the chain"
        roster = [e.model_dump(mode="json") for e in cert.roster]
        return {
            "version": cert.body.version,
            "run_id": self.run_id,
            "cert": cert.raw.decode(),
            "roster": roster,
        }

    def _save_update(self, version: int, raw: bytes) -> None:
        updates = self.dir / "updates"
        updates.mkdir(exist_ok=True)
        atomic_write_bytes(updates / f"{version:08d}.bin", raw)
        for old in updates.glob("*.bin"):  # as many as the states kept
            if old.stem.isdigit() and int(old.stem) <= version - self.store.keep:
                old.unlink(missing_ok=True)

    def _load_update(self, cert: Certificate) -> bytes | None:
        """The saved update of ``cert``'s version if its hash is the certified one, else None."""
        path = self.dir / "updates" / f"{cert.body.version:08d}.bin"
        if cert.body.update_hash is None or not path.is_file():
            return None
        raw = path.read_bytes()
        if hash_update(raw) != cert.body.update_hash:
            log.warning(
                "ignoring the saved update of version %d: not the certified one", cert.body.version
            )
            return None
        return raw

    def restore(self) -> CertifiedState | None:
        """The newest saved certified state whose hash matches its certificate, or None."""
        try:
            ckpt = self.store.load_latest(verify=True)
        except CheckpointError as e:
            log.warning("ignoring the saved state: %s", e)
            return None
        if ckpt is None or ckpt.meta.get("run_id") != self.run_id:
            return None
        try:
            cert = parse_certificate(str(ckpt.meta["cert"]).encode(), run_id=self.run_id)
            cert = _with_saved_roster(cert, ckpt.meta.get("roster"))
            state = CertifiedState.from_tensors(cert.body.version, cert, ckpt.tensors)
        except (InvalidRecord, KeyError, ValueError, ValidationError) as e:
            log.warning("ignoring the saved state: %s", e)
            return None
        if not state.matches(cert):
            log.warning("ignoring the saved state: it does not match its certificate")
            return None
        try:
            state.update = self._load_update(cert)
        except OSError as e:  # unreadable: peers download the whole state from this node
            log.warning("ignoring the saved update of version %d: %s", state.version, e)
        self.saved = state.version
        return state

    # -- serving peers -------------------------------------------------------------------------

    def serve(self, op: str, control: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
        """``cert`` (version, -1 for the newest), ``index`` and ``chunk`` of a held state (its
        parameters alone with ``part`` "params": ADR 0064), and chunk ``i`` of the update that
        made it (``update``; the reply names ``total_bytes``)."""
        version = control.get("version")
        if op == "cert":
            if version == -1 and self.certs:
                version = max(self.certs)
            raw = self.certs.get(version) if isinstance(version, int) else None
            if raw is None:
                raise RpcRefused(Reason.NOT_FOUND, f"no certificate for version {version!r} here")
            return {"version": version}, [raw]
        held = [s for s in (self.current, self.previous) if s is not None and s.version == version]
        if not held:
            raise RpcRefused(Reason.NOT_FOUND, f"state of version {version!r} is not held here")
        i = control.get("i")
        if op == "update":
            update = held[0].update
            if update is None:
                raise RpcRefused(Reason.NOT_FOUND, f"no update of version {version!r} here")
            if not isinstance(i, int) or not 0 <= i * UPDATE_CHUNK_BYTES < max(len(update), 1):
                raise RpcRefused(Reason.OUT_OF_RANGE, "update chunk index out of range")
            part = bytes(update[i * UPDATE_CHUNK_BYTES : (i + 1) * UPDATE_CHUNK_BYTES])
            return {"total_bytes": len(update)}, [part]
        if control.get("part") == "params":  # the parameters alone (ADR 0064)
            blob = held[0].params_blob()
        elif held[0].committee_state:
            blob = held[0].blob()
        else:
            raise RpcRefused(Reason.NOT_FOUND, f"only the parameters of {version!r} are held here")
        if op == "index":
            return {"state_hash": blob.state_hash}, [blob.index_bytes]
        if not isinstance(i, int) or not 0 <= i < len(blob.chunks):
            raise RpcRefused(Reason.OUT_OF_RANGE, "chunk index out of range")
        return {}, [bytes(blob.chunks[i])]


def _with_saved_roster(cert: Certificate, saved: object) -> Certificate:
    """``cert`` with the roster saved beside it, which must hash to the body's ``roster_hash``.
    Raises InvalidRecord (or ValidationError for a malformed entry) otherwise."""
    if not isinstance(saved, list):
        raise InvalidRecord(f"no roster saved with version {cert.body.version}")
    roster = tuple(RosterEntry.model_validate(e) for e in saved)
    if roster_digest(roster) != cert.body.roster_hash:
        raise InvalidRecord(f"the roster saved with version {cert.body.version} is not its own")
    return replace(cert, roster=roster)
