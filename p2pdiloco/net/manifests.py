"""Creating and publishing run manifests (the reading side is ``discovery``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from p2pdiloco.net import keys
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import PROTOCOL_VERSION, RunManifest, run_id_of
from p2pdiloco.protocol.signing import seal
from p2pdiloco.train.model_specs import get_spec

if TYPE_CHECKING:  # hivemind: only publishing needs it, not signing a manifest
    from p2pdiloco.net.dht import DHTPlane


def create_manifest(creator: Identity, **fields: Any) -> tuple[str, RunManifest, bytes]:
    """Build, validate and sign a manifest; returns (run id, manifest, signed envelope).

    Raises ModelError for an unknown model and pydantic's ValidationError (wrapped by the
    caller) for out-of-range hyperparameters.
    """
    get_spec(fields["model"])
    manifest = RunManifest.model_validate(
        {
            "protocol_version": PROTOCOL_VERSION,
            "creator": creator.peer_id,
            "created_at": round(time.time(), 3),
            **fields,
        }
    )
    raw = seal(creator, "manifest", "", manifest.model_dump(mode="json"))
    return run_id_of(manifest), manifest, raw


def publish_manifest(dht: DHTPlane, run_id: str, manifest: RunManifest, raw: bytes) -> None:
    """Store the manifest under the all-runs key and the model's key; NetworkError if no peer
    accepted either store."""
    ok_all = dht.store(keys.runs_key(), run_id, raw, keys.MANIFEST_TTL)
    ok_model = dht.store(keys.model_runs_key(manifest.model), run_id, raw, keys.MANIFEST_TTL)
    if not (ok_all or ok_model):
        from p2pdiloco.net.dht import NetworkError

        raise NetworkError("no DHT peer accepted the manifest (is a bootstrap server reachable?)")
