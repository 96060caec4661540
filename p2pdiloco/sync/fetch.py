"""Client side of the state service: certificates, chain verification, chunked state download.

A node that falls behind (or joins late, or restarts) verifies every certificate from the last
version it trusts to the newest one — each must be signed by a quorum of exactly the committee
that the previous certificate elects, and carry the roster that follows from it — then
downloads the newest state in chunks from several peers at once. Each chunk is checked against
the index, and the index against the certificate's state hash, so a lying peer can waste a
request but never get a byte of bad state applied. A node one version behind downloads the
certified update instead (``download_update``, ADR 0029), checked against the certificate's
update hash; the caller applies it and checks the state hash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from p2pdiloco.core.roster import verify_successor
from p2pdiloco.net.cert_records import cert_version, fetch_cert
from p2pdiloco.net.sync_rpc import RpcError
from p2pdiloco.net.transport import Transport
from p2pdiloco.protocol.certificates import Certificate, parse_certificate
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.sync.certified import CertifiedState, apply_update
from p2pdiloco.sync.state import StateError, decode_state, parse_index, verify_chunk
from p2pdiloco.sync.update import UPDATE_CHUNK_BYTES, hash_update, max_update_bytes, rules_codec
from p2pdiloco.train.configs import OuterConfig

log = logging.getLogger(__name__)

PER_PEER_PARALLEL = 4
# Peers asked for one certificate while catching up before that version counts as missing.
MAX_PEERS_PER_VERSION = 6
# Peers asked for a certified update before the node downloads the whole state instead.
MAX_UPDATE_PEERS = 3


class SyncError(Exception):
    """No peer could provide a verifiable certificate or state (one-line message)."""


@dataclass
class Download:
    state: CertifiedState
    chunks_by_peer: Counter[str] = field(default_factory=Counter)


def verify_next(
    run_id: str, manifest: RunManifest, prev: Certificate | None, raw: bytes
) -> Certificate:
    """Parse and check the certificate of the version after ``prev`` (None: genesis): quorum
    signatures, then the chain rules of ``roster.verify_successor``; returned with its roster.
    Raises InvalidRecord."""
    return verify_successor(run_id, manifest, prev, parse_certificate(raw, run_id=run_id))


FETCH_TRIES = 3  # rounds over a submission's holders before a fetch counts as failed
FETCH_PAUSE_S = 0.5  # before the second round; doubled before each later one


async def fetch_submission(
    transport: Transport, digest: str, holders: Sequence[str], reply_limit: int
) -> list[bytes]:
    """The frames of submission ``digest`` from the first of ``holders`` that serves it,
    going round them ``FETCH_TRIES`` times with a growing pause (a dropped stream or a member
    still installing the round costs a retry, not the round); RpcError naming every failure."""
    errors: list[str] = []
    for attempt in range(FETCH_TRIES):
        if attempt:
            await asyncio.sleep(FETCH_PAUSE_S * 2 ** (attempt - 1))
        for peer in holders:
            try:
                args = {"digest": digest}
                _, frames = await transport.call(peer, "fetch", args=args, reply_limit=reply_limit)
                return frames
            except RpcError as e:
                errors.append(f"{peer[-8:]}: {e}")
    raise RpcError(f"after {FETCH_TRIES} rounds: " + "; ".join(errors)[-400:])


async def catch_up(
    transport: Transport,
    run_id: str,
    manifest: RunManifest,
    known: Certificate | None,
    target: Certificate,
    peers: Callable[[int], Sequence[str]],
) -> list[Certificate]:
    """Verified certificates after ``known`` towards ``target``, each fetched from the first of
    ``peers(version)`` (at most ``MAX_PEERS_PER_VERSION``) that serves one.

    A certificate's version means nothing until the chain reaches it: each version is verified
    against the one before, so the walk stops at ``target`` or at the first version no peer
    serves verifiably, and returns the verified prefix (``chain[-1]`` is then below ``target``,
    whose claim the caller ignores). A junk certificate claiming version 10**9 thus costs one
    failed fetch round past the real chain, never 10**9 of them. Raises SyncError only if not
    even the next version verifies.
    """
    chain: list[Certificate] = []
    prev = known
    start = known.body.version if known is not None else 0
    for version in range(start + 1, target.body.version + 1):
        raw = target.raw if version == target.body.version else None
        errors = []
        for peer in [""] if raw is not None else list(peers(version))[:MAX_PEERS_PER_VERSION]:
            try:
                data = raw if raw is not None else await fetch_cert(transport, peer, version)
                cert = verify_next(run_id, manifest, prev, data)
                break
            except (RpcError, InvalidRecord) as e:
                errors.append(f"{peer or 'given'}: {e}")
        else:
            why = "; ".join(errors)[:400] or "no peer holds it"
            if not chain:
                raise SyncError(
                    f"ignoring the certificate claiming version {target.body.version} for now: no "
                    f"verifiable certificate for version {version} ({why})"
                )
            log.warning(
                "ignoring the certificate claiming version %d: the chain is verifiable only to "
                "version %d (%s)",
                target.body.version,
                chain[-1].body.version,
                why,
            )
            return chain
        chain.append(cert)
        prev = cert
    return chain


async def walk_chain(
    transport: Transport,
    run_id: str,
    manifest: RunManifest,
    peers: Sequence[str],
    hints: Sequence[bytes] = (),
) -> list[Certificate]:
    """The run's chain from genesis, as far as it verifies: each version from ``hints`` (say,
    DHT records) when one verifies against the version before, else from the first of ``peers``
    that serves one. Stops at the first version neither provides, so a junk certificate claiming
    version 10**9 is never walked to; a peer that cannot be reached is not asked again."""
    by_version: dict[int, list[bytes]] = {}
    for raw in hints:
        by_version.setdefault(cert_version(raw), []).append(raw)
    chain: list[Certificate] = []
    alive = list(peers)
    while True:
        version = len(chain) + 1
        prev = chain[-1] if chain else None
        cert = None
        for raw in by_version.get(version, []):
            with contextlib.suppress(InvalidRecord):
                cert = verify_next(run_id, manifest, prev, raw)
                break
        for peer in list(alive) if cert is None else []:
            try:
                cert = verify_next(
                    run_id, manifest, prev, await fetch_cert(transport, peer, version)
                )
                break
            except RpcError as e:
                if e.code is Reason.UNREACHABLE:
                    alive.remove(peer)
            except InvalidRecord as e:
                log.info("certificate %d from %s: %s", version, peer, e)
        if cert is None:
            return chain
        chain.append(cert)


async def download_state(
    transport: Transport,
    cert: Certificate,
    peers: Sequence[str],
    progress: Callable[[int, int, float], None] | None = None,
    *,
    part: str | None = None,
) -> Download:
    """The state certified by ``cert``, chunks spread over ``peers`` and verified one by one.
    ``progress(bytes_done, bytes_total, seconds)`` is called after every verified chunk.

    ``part`` (ADR 0064): "params", the parameters alone, checked against the certificate's
    ``params_hash`` (what a learner needs, without the committee state); "committee", the whole
    state for a syncer about to merge on it (the transport counts it as committee duty, not as
    a learner's following the run); None, the whole state."""
    version, state_hash = cert.body.version, cert.body.state_hash
    if part == "params":
        if cert.body.params_hash is None:
            raise SyncError(f"the certificate of version {version} names no params hash")
        state_hash = cert.body.params_hash
    extra: dict[str, object] = {"part": part} if part is not None else {}
    index = None
    for peer in peers:
        try:
            _, frames = await transport.call(
                peer, "index", args={"version": version, **extra}, reply_limit=16 << 20
            )
            index = parse_index(frames[0], state_hash)
            break
        except (RpcError, StateError, IndexError) as e:
            log.info("state index of version %d from %s: %s", version, peer, e)
    if index is None:
        raise SyncError(f"no peer served a valid state index for version {version}")
    holders = list(peers)
    chunks: list[bytes | None] = [None] * len(index.chunk_hashes)
    by_peer: Counter[str] = Counter()
    limits = {peer: asyncio.Semaphore(PER_PEER_PARALLEL) for peer in holders}
    failed: set[str] = set()
    started, done, total = time.monotonic(), 0, index.chunk_bytes * len(chunks)

    async def get(i: int) -> None:
        nonlocal done
        order = holders[i % len(holders) :] + holders[: i % len(holders)]
        for peer in order:
            if peer in failed and len(failed) < len(holders):
                continue
            async with limits[peer]:
                try:
                    _, frames = await transport.call(
                        peer,
                        "chunk",
                        args={"version": version, "i": i, **extra},
                        reply_limit=index.chunk_bytes,
                    )
                    verify_chunk(index, i, frames[0])
                except (RpcError, StateError, IndexError) as e:
                    log.info("chunk %d of version %d from %s: %s", i, version, peer, e)
                    failed.add(peer)
                    continue
            chunks[i] = frames[0]
            by_peer[peer] += 1
            done += len(frames[0])
            if progress is not None:
                progress(done, max(total, done), time.monotonic() - started)
            return
        raise SyncError(f"no peer served a valid chunk {i} of version {version}")

    await asyncio.gather(*(get(i) for i in range(len(chunks))))
    tensors = decode_state(index, [c for c in chunks if c is not None])
    return Download(CertifiedState.from_tensors(version, cert, tensors), by_peer)


async def follow_update(
    transport: Transport,
    manifest: RunManifest,
    base: CertifiedState,
    cert: Certificate,
    peers: Sequence[str],
) -> tuple[CertifiedState, str]:
    """The state ``cert`` certifies, made from ``base`` (the version before) by the certified
    update (``download_update``, then ``certified.apply_update`` in a worker thread), and the
    peer that served the update. Raises SyncError (no peer served it) or UpdateError (it does
    not give the certified state): download the whole state instead."""
    shapes = {n: tuple(t.shape) for n, t in base.params.items()}
    limit = max_update_bytes(rules_codec(manifest.rules), shapes)
    raw, peer = await download_update(transport, cert, peers, limit)
    outer = OuterConfig(**manifest.outer.model_dump())
    state = await asyncio.get_running_loop().run_in_executor(
        None, apply_update, base, cert, raw, manifest.rules, outer
    )
    return state, peer


async def follow_updates(
    transport: Transport,
    manifest: RunManifest,
    base: CertifiedState,
    chain: Sequence[Certificate],
    holders: Callable[[Certificate], Sequence[str]],
) -> CertifiedState:
    """The state of ``chain[-1]`` made from ``base`` by each certificate's update in turn
    (``follow_update``, from ``holders(cert)``). Raises SyncError for a certificate that names
    no update or is not the next version, and what ``follow_update`` raises."""
    state = base
    for cert in chain:
        if cert.body.update_hash is None or cert.body.version != state.version + 1:
            raise SyncError(f"no update certified from version {state.version}")
        state, peer = await follow_update(transport, manifest, state, cert, holders(cert))
        log.info(
            "version %d made from its certified update (%d bytes from %s)",
            state.version,
            len(state.update or b""),
            peer[-8:],
        )
    return state


async def download_update(
    transport: Transport, cert: Certificate, peers: Sequence[str], max_bytes: int
) -> tuple[bytes, str]:
    """The update ``cert`` names (its bytes, and the peer that served them), from the first of
    ``peers`` (at most ``MAX_UPDATE_PEERS``) whose bytes hash to ``cert.body.update_hash``. A
    peer serving other bytes is logged with the code and skipped, never believed. Raises
    SyncError when no peer served it: download the whole state instead."""
    version, want = cert.body.version, cert.body.update_hash
    if want is None:
        raise SyncError(f"the certificate of version {version} names no update")
    errors: list[str] = []
    for peer in list(peers)[:MAX_UPDATE_PEERS]:
        try:
            raw = await _update_from(transport, peer, version, max_bytes)
        except RpcError as e:
            errors.append(f"{peer[-8:]}: {e}")
            continue
        if hash_update(raw) == want:
            return raw, peer
        log.warning(
            "update of version %d from %s refused [%s]: its %d bytes do not match the "
            "certified update hash",
            version,
            peer,
            Reason.DIGEST_MISMATCH.value,
            len(raw),
        )
        errors.append(f"{peer[-8:]}: {Reason.DIGEST_MISMATCH.value}")
    raise SyncError(f"no peer served the update of version {version} ({'; '.join(errors)[:300]})")


async def _update_from(transport: Transport, peer: str, version: int, max_bytes: int) -> bytes:
    """All chunks of ``peer``'s update of ``version``: the first says the total (bounded)."""

    async def chunk(i: int) -> tuple[dict[str, object], bytes]:
        reply, frames = await transport.call(
            peer, "update", args={"version": version, "i": i}, reply_limit=UPDATE_CHUNK_BYTES
        )
        if len(frames) != 1:
            raise RpcError(f"{peer} answered an update request without one", code=Reason.MALFORMED)
        return reply, frames[0]

    reply, first = await chunk(0)
    total = reply.get("total_bytes")
    if not isinstance(total, int) or isinstance(total, bool) or not 0 < total <= max_bytes:
        raise RpcError(f"{peer} announced an update of {total!r} bytes", code=Reason.MALFORMED)
    n = -(-total // UPDATE_CHUNK_BYTES)
    limit = asyncio.Semaphore(PER_PEER_PARALLEL)

    async def limited(i: int) -> bytes:
        async with limit:
            return (await chunk(i))[1]

    rest = await asyncio.gather(*(limited(i) for i in range(1, n)))
    raw = b"".join([first, *rest])
    if len(raw) != total:
        raise RpcError(f"{peer} served {len(raw)} update bytes, not {total}", code=Reason.MALFORMED)
    return raw
