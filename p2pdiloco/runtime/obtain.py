"""How a node gets the state of a verified certificate chain (ADR 0029).

In order of cost: its own merge, when it sat on the committee and its state is the certified
one; the certified updates, when it holds the version one or two below (a fraction of the
state's bytes, applied to its own parameters and momentum, checked against the state hash);
else the whole state, chunk by verified chunk from several peers. Whatever path, the state's
hash is the certificate's before it is returned.

In runs whose update is the parameters' change (``rules.update_form`` "params", ADR 0064) a
follower holds the parameters alone, checked against the certificate's ``params_hash``, and a
download fetches only them; a node elected to a committee fetches the committee state
(momentum and residual, with the parameters) once it needs it (``committee_state``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from p2pdiloco.net.transport import Transport
from p2pdiloco.protocol.certificates import Certificate
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.runtime.status import Tally
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.sync.fetch import SyncError, download_state, follow_updates
from p2pdiloco.sync.update import UpdateError

log = logging.getLogger(__name__)

MAX_CHAINED_UPDATES = 2  # versions behind that a node follows by updates (peers keep two)

Holders = Callable[..., list[str]]  # (certificate, version=None) → peers likely to hold it


async def obtain_state(
    transport: Transport,
    manifest: RunManifest,
    base: CertifiedState | None,
    chain: list[Certificate],
    computed: CertifiedState | None,
    holders: Holders,
    tally: Tally,
) -> CertifiedState:
    """The state certified by ``chain[-1]`` (``chain`` verified, starting after ``base``).
    Raises what ``download_state`` raises when no path gives it."""
    cert = chain[-1]
    if computed is not None and computed.state_hash == cert.body.state_hash:
        computed.cert = cert
        if computed.update_hash != cert.body.update_hash:
            computed.update = None  # never serve an update its certificate does not name
        return computed
    updated = await _follow_updates(transport, manifest, base, chain, holders, tally)
    if updated is not None:
        return updated
    tally.phase = "downloading"
    v = cert.body.version
    dl = await download_state(
        transport,
        cert,
        holders(cert),
        lambda d, t, s: tally.download_progress(v, d, t, s),
        part="params" if manifest.rules.update_form == "params" else None,
    )
    tally.record_download(v, dict(dl.chunks_by_peer))
    return dl.state


async def committee_state(
    transport: Transport, state: CertifiedState, holders: Holders, tally: Tally
) -> CertifiedState:
    """``state`` with its committee state (momentum, residual: ADR 0064), downloaded whole and
    checked against its certificate's ``state_hash``; the update it holds is kept. ``state``
    itself when it holds them already. Raises SyncError when no peer serves it."""
    if state.committee_state or state.cert is None:
        return state
    cert, v = state.cert, state.version
    dl = await download_state(
        transport,
        cert,
        holders(cert),
        lambda d, t, s: tally.download_progress(v, d, t, s),
        part="committee",
    )
    tally.record_download(v, dict(dl.chunks_by_peer))
    full = dl.state
    full.update = state.update
    log.info("version %d: committee state downloaded to merge on", v)
    return full


async def _follow_updates(
    transport: Transport,
    manifest: RunManifest,
    base: CertifiedState | None,
    chain: list[Certificate],
    holders: Holders,
    tally: Tally,
) -> CertifiedState | None:
    """The state of ``chain[-1]`` made by its certified updates, or None: download it."""
    if base is None or not 0 < len(chain) <= MAX_CHAINED_UPDATES:
        return None
    try:
        state = await follow_updates(transport, manifest, base, chain, holders)
    except (SyncError, UpdateError, ValueError) as e:
        code = e.code.value if isinstance(e, UpdateError) else "unavailable"
        log.warning(
            "version %d: no usable update [%s] (%s); downloading the state",
            chain[-1].body.version,
            code,
            e,
        )
        tally.update_fallbacks += 1
        return None
    tally.updates += len(chain)
    return state
