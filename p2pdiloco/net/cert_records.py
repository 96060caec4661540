"""Certificates in the DHT and on gossip: how late joiners and leaderboards find them.

Each node keeps the newest certificate it applied under ``p2pdiloco/v1/run/<run>/certs``, in
its own subkey, wrapped in an envelope it signs (the DHT validator accepts only envelopes); the
certificate inside is verified by whoever reads it, never trusted for its wrapper. Certificates
are also gossiped raw on the run's certificate topic when they fit a gossip message. Older
versions, and certificates too large for a record or a gossip message, are served by nodes over
the sync protocol (``cert`` op), which ``fetch_cert`` asks.
"""

from __future__ import annotations

import json
import logging

from p2pdiloco.net import keys
from p2pdiloco.net.dht import DHTPlane, NetworkError
from p2pdiloco.net.gossip import GossipError, GossipProcess
from p2pdiloco.net.gossip_limits import MAX_MESSAGE_BYTES
from p2pdiloco.net.sync_rpc import RpcError
from p2pdiloco.net.transport import Transport
from p2pdiloco.protocol.certificates import MAX_CERTIFICATE_BYTES, Certificate, parse_certificate
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.signing import InvalidRecord, canonical_json, seal

log = logging.getLogger(__name__)

CERT_RECORD_KIND = "certificate"
CERT_RECORD_TTL = keys.CERT_RECORD_TTL
MAX_RECORD = 16 * 1024


def certs_key(run_id: str) -> str:
    return keys.run_certs_key(run_id)


def cert_topic(run_id: str) -> str:
    return f"{keys.PREFIX}/run/{run_id}/certs"


def run_of_cert_topic(topic: str) -> str | None:
    """The run whose certificate topic ``topic`` is (:func:`cert_topic`); None for any other."""
    head, tail = f"{keys.PREFIX}/run/", "/certs"
    run = topic[len(head) : -len(tail)] if topic.startswith(head) and topic.endswith(tail) else ""
    return run if len(run) == 64 and all(c in "0123456789abcdef" for c in run) else None


def cert_version(raw: bytes) -> int:
    """The version an (unverified) certificate claims, for ordering only; -1 if unreadable."""
    try:
        v = json.loads(raw)["body"]["version"]
    except Exception:  # junk from a peer: sorts first, then fails verification
        return -1
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def signed_claims(raws: list[bytes], run_id: str, above: int = 0) -> list[bytes]:
    """Certificates among ``raws`` above version ``above`` that carry a quorum of signatures of
    the committee they name, newest first, each once (whether that is the elected committee
    needs its chain: ``catch_up``)."""
    out: dict[bytes, None] = {}
    for raw in sorted(raws, key=cert_version, reverse=True):
        if cert_version(raw) <= above or raw in out:
            continue
        try:
            parse_certificate(raw, run_id=run_id)
        except InvalidRecord:
            continue
        out[raw] = None
    return list(out)


def read_certificates(dht: DHTPlane, run_id: str) -> list[bytes]:
    """Certificate bytes found in the DHT (unverified: parse and verify before use)."""
    out = []
    try:
        for rec in dht.read(certs_key(run_id), kind=CERT_RECORD_KIND, run_id=run_id):
            cert = rec.envelope.body.get("cert")
            if isinstance(cert, dict):
                out.append(canonical_json(cert))
    except Exception as e:  # the DHT is a hint here; peers also serve certificates
        log.info("reading certificates from the DHT failed: %s", e)
    return out


def publish_certificate(
    identity: Identity,
    run_id: str,
    cert: Certificate,
    dht: DHTPlane | None,
    gossip: GossipProcess | None,
) -> None:
    """Gossip ``cert`` and store it as this node's newest certificate in the DHT, each where it
    fits; a larger certificate (a round of over about 1,400 inputs) is fetched from the nodes
    that announce its version (``cert`` op, ADR 0047)."""
    if gossip is not None and gossip.alive and len(cert.raw) <= MAX_MESSAGE_BYTES:
        try:
            gossip.publish(cert_topic(run_id), cert.raw)
        except GossipError as e:
            log.info("gossip publish of the certificate failed: %s", e)
    if dht is not None:
        store_certificate(identity, run_id, cert, dht)


def store_certificate(identity: Identity, run_id: str, cert: Certificate, dht: DHTPlane) -> None:
    """Store ``cert`` as this node's newest certificate record, sealed afresh (a certificate
    record's signed time bounds its expiry); nothing if it is too large for a record. Called on
    every new version and again in each heartbeat interval this node is drawn for
    (``net.republish``)."""
    body = {"version": cert.body.version, "cert": json.loads(cert.raw)}
    record = seal(identity, CERT_RECORD_KIND, run_id, body)
    if len(record) > MAX_RECORD:
        return  # too large for a DHT record; peers serve it over the sync protocol
    try:
        dht.store(certs_key(run_id), identity.peer_id, record, CERT_RECORD_TTL)
    except NetworkError as e:
        log.info("storing the certificate in the DHT failed: %s", e)


async def fetch_cert(transport: Transport, peer: str, version: int) -> bytes:
    """Certificate bytes of ``version`` (-1: the peer's newest) from ``peer``; RpcError."""
    _, frames = await transport.call(
        peer, "cert", args={"version": version}, timeout=15.0, reply_limit=MAX_CERTIFICATE_BYTES
    )
    if len(frames) != 1:
        raise RpcError(f"{peer} answered a certificate request without one", code=Reason.MALFORMED)
    return frames[0]
