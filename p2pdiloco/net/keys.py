"""DHT key layout. Every value is a signed envelope (``p2pdiloco.protocol.signing``).

| key                                   | subkey      | value (envelope kind)   | expiry            |
|---------------------------------------|-------------|-------------------------|-------------------|
| ``p2pdiloco/v1/runs``                 | run id      | ``manifest``            | manifest TTL      |
| ``p2pdiloco/v1/runs/<model>``         | run id      | ``manifest``            | manifest TTL      |
| ``p2pdiloco/v1/run/<run id>/peers``   | peer id     | ``heartbeat``           | heartbeat TTL     |
| ``p2pdiloco/v1/run/<run id>/certs``   | peer id     | ``certificate``         | certificate TTL   |
| ``p2pdiloco/v1/run/<run id>/islands`` | peer id     | ``island``              | heartbeat TTL     |
| ``p2pdiloco/v1/bootstraps``           | peer id     | ``heartbeat`` (run "")  | heartbeat TTL     |

Keys are plain strings (hivemind hashes them into DHT ids); subkeys are the ids they name, so one
peer can only ever overwrite its own slot. ``net.record_rules`` checks, when a record is stored
and when it is read, that a record sits in exactly the slot its content names.
"""

from __future__ import annotations

PREFIX = "p2pdiloco/v1"

# Seconds: a heartbeat lives this long in the DHT; nodes refresh every HEARTBEAT_INTERVAL.
HEARTBEAT_TTL = 30.0
HEARTBEAT_INTERVAL = 5.0
# Manifests are re-published by every member of a run, so they outlive their creator.
MANIFEST_TTL = 24 * 3600.0
# The longest heartbeat TTL a DHT node stores (``join --heartbeat-ttl`` above it is refused).
MAX_HEARTBEAT_TTL = 300.0
# Certificate records: each node's newest applied certificate, re-stored on every new version.
CERT_RECORD_TTL = 24 * 3600.0


def runs_key() -> str:
    return f"{PREFIX}/runs"


def model_runs_key(model: str) -> str:
    return f"{PREFIX}/runs/{model}"


def run_peers_key(run_id: str) -> str:
    return f"{PREFIX}/run/{run_id}/peers"


def bootstraps_key() -> str:
    return f"{PREFIX}/bootstraps"


def run_certs_key(run_id: str) -> str:
    return f"{PREFIX}/run/{run_id}/certs"


def run_islands_key(run_id: str) -> str:
    """LAN islands' rendezvous records (``island``), one per rank 0."""
    return f"{PREFIX}/run/{run_id}/islands"
