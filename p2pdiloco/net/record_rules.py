"""What a DHT record may claim: checked where it is stored and again where it is read (sans-IO).

A valid signature only says who wrote a record, not that it belongs where it sits. Without these
rules anyone could squat a run's manifest slot with their own signed record and a 10-year expiry
(hivemind keeps the latest expiry per slot, so the real manifest could never replace it), or
replay a victim's heartbeat with a 10-year expiry to freeze its slot. ``check_record`` refuses,
each with a ``Reason`` code:

- a kind no slot holds (UNKNOWN_KIND); a body failing its schema (MALFORMED);
- a body speaking for a peer other than its signer (WRONG_SIGNER);
- a key or subkey other than the one the content names (WRONG_SLOT): a heartbeat only under
  its run's peers key (bootstraps key for run "") in the signer's subkey; a manifest only under
  the all-runs key or its model's key, in the subkey equal to its own hash (the run id), signed
  by its creator; a certificate record only under its run's certs key, in the signer's subkey;
  an island rendezvous only under its run's islands key, in the signer's subkey;
- a signed time more than ``SKEW`` ahead of local time, or (heartbeats, certificate records,
  re-signed at every store) older than the kind's TTL plus ``SKEW`` (BAD_TIMESTAMP);
- an expiry more than the kind's TTL plus ``SKEW`` after now, or after the signed time
  (BAD_EXPIRY);
- a certificate record whose certificate does not carry a quorum of valid signatures of the
  committee it names, is for another run, or whose claimed version differs from its body's
  (UNVERIFIED). Whether that committee is the elected one needs the chain, which a DHT node
  does not hold: readers verify the chain before they believe a version (``sync.fetch``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from p2pdiloco.net import keys
from p2pdiloco.protocol.certificates import CERTIFICATE_KIND, parse_certificate
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import (
    HEARTBEAT_KIND,
    ISLAND_KIND,
    MANIFEST_KIND,
    IncompatibleProtocol,
    parse_heartbeat,
    parse_island,
    parse_manifest,
    run_id_of_body,
)
from p2pdiloco.protocol.signing import Envelope, InvalidRecord, canonical_json

log = logging.getLogger(__name__)

# Seconds a signed time or an expiry may run ahead of this node's clock (volunteers' clocks
# drift; NTP keeps them well within this).
SKEW = 300.0
TTL = {
    HEARTBEAT_KIND: keys.MAX_HEARTBEAT_TTL,
    MANIFEST_KIND: keys.MANIFEST_TTL,
    CERTIFICATE_KIND: keys.CERT_RECORD_TTL,
    ISLAND_KIND: keys.MAX_HEARTBEAT_TTL,
}
# Kinds re-signed at every store: their signed time must be recent, and bounds their expiry.
_FRESH = (HEARTBEAT_KIND, CERTIFICATE_KIND, ISLAND_KIND)


class RecordRefused(Exception):
    """A record that must not be stored or used: ``code`` says why, the text says how;
    ``signer`` is the peer the record names, when it got that far."""

    def __init__(self, code: Reason, text: str, signer: str | None = None) -> None:
        super().__init__(text)
        self.code = code
        self.signer = signer


def check_record(
    env: Envelope,
    key: bytes | str,
    subkey: object,
    expiration: float,
    *,
    key_id: Callable[[str], bytes | str] = lambda k: k,
    now: float | None = None,
) -> None:
    """Raise RecordRefused unless ``env`` may sit under (``key``, ``subkey``) until ``expiration``.

    ``key_id`` maps a plain key to the form ``key`` has (hivemind hands the validator hashed DHT
    ids); ``now`` defaults to the local clock. The envelope's signature is already verified.
    """
    try:
        _check(env, key, subkey, expiration, key_id, time.time() if now is None else now)
    except RecordRefused as e:
        e.signer = env.signer
        raise


def _check(
    env: Envelope,
    key: bytes | str,
    subkey: object,
    expiration: float,
    key_id: Callable[[str], bytes | str],
    now: float,
) -> None:
    ttl = TTL.get(env.kind)
    if ttl is None:
        raise RecordRefused(Reason.UNKNOWN_KIND, f"no DHT slot holds {env.kind[:32]!r} records")
    if env.ts > now + SKEW:
        raise RecordRefused(Reason.BAD_TIMESTAMP, f"signed {env.ts - now:.0f} s in the future")
    if env.kind in _FRESH and env.ts < now - ttl - SKEW:
        raise RecordRefused(Reason.BAD_TIMESTAMP, f"signed {now - env.ts:.0f} s ago")
    limit = now + ttl + SKEW
    if env.kind in _FRESH:
        limit = min(limit, env.ts + ttl + SKEW)
    if expiration > limit:
        raise RecordRefused(
            Reason.BAD_EXPIRY,
            f"expiry {expiration - now:.0f} s from now exceeds the {env.kind} TTL of {ttl:.0f} s",
        )
    slots = _slots(env)
    if (key, subkey) not in {(key_id(k), s) for k, s in slots}:
        raise RecordRefused(Reason.WRONG_SLOT, f"{env.kind} stored outside the slot it names")


def _slots(env: Envelope) -> list[tuple[str, str]]:
    """The (key, subkey) pairs a verified envelope may occupy; RecordRefused for a bad body."""
    try:
        if env.kind == HEARTBEAT_KIND:
            parse_heartbeat(env)
            key = keys.bootstraps_key() if env.run == "" else keys.run_peers_key(env.run)
            return [(key, env.signer)]
        if env.kind == MANIFEST_KIND:
            return _manifest_slots(env)
        if env.kind == ISLAND_KIND:
            parse_island(env)
            return [(keys.run_islands_key(env.run), env.signer)]
        return _certificate_slots(env)
    except InvalidRecord as e:
        code = Reason.WRONG_SIGNER if e.signer_verified else Reason.MALFORMED
        raise RecordRefused(code, str(e)) from None


def _manifest_slots(env: Envelope) -> list[tuple[str, str]]:
    try:
        run_id, manifest = parse_manifest(env)
        return [(keys.runs_key(), run_id), (keys.model_runs_key(manifest.model), run_id)]
    except IncompatibleProtocol:
        # Another protocol's manifest is kept (its readers get an upgrade message); check what
        # every version shares: its hash is its run id, and its creator signed it.
        if env.body.get("creator") != env.signer:
            raise RecordRefused(
                Reason.WRONG_SIGNER, "manifest creator differs from its signer"
            ) from None
        run_id, model = run_id_of_body(env.body), env.body.get("model")
        slots = [(keys.runs_key(), run_id)]
        if isinstance(model, str) and 0 < len(model) <= 64 and model.isprintable():
            slots.append((keys.model_runs_key(model), run_id))
        return slots


def _certificate_slots(env: Envelope) -> list[tuple[str, str]]:
    cert, version = env.body.get("cert"), env.body.get("version")
    if set(env.body) != {"cert", "version"} or not isinstance(cert, dict):
        raise RecordRefused(Reason.MALFORMED, "certificate record must hold 'version' and 'cert'")
    try:
        parsed = parse_certificate(canonical_json(cert), run_id=env.run)
    except (InvalidRecord, ValueError, TypeError) as e:
        raise RecordRefused(Reason.UNVERIFIED, f"certificate record: {e}") from None
    if parsed.body.version != version:
        raise RecordRefused(Reason.UNVERIFIED, "certificate record claims another version")
    return [(keys.run_certs_key(env.run), env.signer)]


@dataclass
class _Seen:
    last: float
    suppressed: int = 0


class RejectionLog:
    """One warning per (peer, code) per ``interval`` seconds; the rest are counted and the count
    is reported with the next warning. Remembers at most ``max_keys`` pairs (the least recently
    logged are forgotten), so a flood of fresh identities costs bounded memory."""

    def __init__(self, interval: float = 60.0, max_keys: int = 1024) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self._seen: OrderedDict[tuple[str, Reason], _Seen] = OrderedDict()

    def warn(
        self, what: str, peer: str | None, code: Reason, text: str, now: float | None = None
    ) -> bool:
        """Log ``what`` refused from ``peer``; True if a line was written."""
        now = time.monotonic() if now is None else now
        key = (peer or "unknown peer", code)
        seen = self._seen.get(key)
        if seen is not None and now - seen.last < self.interval:
            seen.suppressed += 1
            return False
        more = f" (+{seen.suppressed} more like it)" if seen and seen.suppressed else ""
        log.warning("refused %s from %s [%s]: %s%s", what, key[0], code.value, text[:300], more)
        self._seen[key] = _Seen(now)
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return True
