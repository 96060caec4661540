"""A certified version of a run read back from a node's state directory, verified, as a model.

A node keeps, under its state directory (``runtime.chain``): the signed manifest
(``manifest.json``), every certificate it applied (``certs/``) and its newest certified states
(``certified/ckpt-<version>.safetensors``). A version is handed out (``export``, ``sample``)
only if the certificate chain verifies from genesis up to it (``ledger.verified_chain``: the
quorum of each elected committee, the roster that follows) and the state's bytes hash to the
state hash its certificate signs: what leaves the directory is what the run certified, not
what a file says. Failures raise ``ExportError`` with one line naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from p2pdiloco.core.ledger import Ledger, build_ledger, verified_chain
from p2pdiloco.errors import UserError
from p2pdiloco.protocol.certificates import Certificate, body_digest
from p2pdiloco.protocol.records import RunManifest, parse_manifest
from p2pdiloco.protocol.signing import InvalidRecord, open_envelope
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.train.checkpoint import CheckpointError, CheckpointStore, load_checkpoint


class ExportError(UserError):
    """No certified version of the run can be read and verified here (one-line message)."""


@dataclass
class CertifiedVersion:
    """One verified version of a run: its state's parameters and what certifies them."""

    run_id: str
    manifest: RunManifest
    cert: Certificate  # verified as the successor of the chain before it
    params: dict[str, torch.Tensor]  # fp32, CPU
    ledger: Ledger  # the receipts of versions 1..version

    @property
    def version(self) -> int:
        return self.cert.body.version

    @property
    def cert_hash(self) -> str:
        """The certificate's body digest: equal on every node, whatever signatures it holds."""
        return body_digest(self.cert.body)

    def params_count(self) -> int:
        return sum(t.numel() for t in self.params.values())


def read_manifest(state_dir: Path) -> tuple[str, RunManifest]:
    """The run id and manifest a node saved in ``state_dir``; ExportError if none verifies."""
    path = state_dir / "manifest.json"
    if not path.is_file():
        raise ExportError(f"no certified state under {state_dir}: no run manifest there")
    try:
        return parse_manifest(open_envelope(path.read_bytes(), kind="manifest"))
    except (OSError, InvalidRecord) as e:
        raise ExportError(f"the run manifest in {state_dir} does not verify: {e}") from None


def load_certified(
    state_dir: Path, run: str | None = None, version: int | None = None
) -> CertifiedVersion:
    """Version ``version`` of the run saved in ``state_dir`` (None: the newest one held whose
    chain verifies), checked as the module says. ``run``: a prefix the run id must start with.

    Raises ExportError if the directory holds no manifest of that run, no state, not that
    version, a chain that does not verify up to it, or a state that is not the certified one.
    """
    run_id, manifest = read_manifest(state_dir)
    if run is not None and not run_id.startswith(run):
        raise ExportError(f"{state_dir} holds run {run_id[:16]}, not {run}")
    store = CheckpointStore(state_dir / "certified")
    held = store.versions()  # newest first
    if not held:
        raise ExportError(f"no certified state of run {run_id[:16]} under {state_dir}")
    raws = [p.read_bytes() for p in sorted((state_dir / "certs").glob("*.json"))]
    chain, ignored = verified_chain(run_id, manifest, raws)
    why = f": {ignored[0]}" if ignored else ""
    if version is None:
        ok = [v for v in held if v <= len(chain)]
        if not ok:
            raise ExportError(
                f"the certificate chain of run {run_id[:16]} does not verify up to version "
                f"{held[0]} (verified: {len(chain)}){why}"
            )
        version = ok[0]
    elif version not in held:
        shown = ", ".join(map(str, sorted(held)))
        raise ExportError(
            f"version {version} of run {run_id[:16]} is not held here (held: {shown})"
        )
    elif version > len(chain):
        raise ExportError(
            f"the certificate chain of run {run_id[:16]} does not verify up to version {version} "
            f"(verified: {len(chain)}){why}"
        )
    cert = chain[version - 1]
    try:
        ckpt = load_checkpoint(store.path_for(version), verify=True)
        state = CertifiedState.from_tensors(version, cert, ckpt.tensors)
    except (CheckpointError, ValueError) as e:
        raise ExportError(f"version {version} of run {run_id[:16]}: {e}") from None
    if not state.matches(cert):
        raise ExportError(
            f"the state of version {version} under {state_dir} is not the one its certificate "
            "signs (state hash differs)"
        )
    ledger = build_ledger(run_id, manifest, [c.raw for c in chain[:version]])
    return CertifiedVersion(run_id, manifest, cert, state.params, ledger)


def model_card(cv: CertifiedVersion) -> str:
    """The exported directory's README.md: what the weights are and who trained them."""
    m, ledger = cv.manifest, cv.ledger
    rows = "\n".join(
        f"| {i} | `{e.peer_id}` | {e.tokens:,} | {e.accepted} |"
        for i, e in enumerate(ledger.entries, 1)
    )
    plan = (
        f"{m.plan.tokens:,} tokens ({m.plan.rounds} rounds of {m.plan.learners} learners)"
        if m.plan is not None
        else "not stated (made before run plans)"
    )
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
- p2pdiloco
- diloco
---

# {m.name}, version {cv.version}

A `{m.model}` ({cv.params_count():,} parameters) trained by volunteers with p2pdiloco
(peer-to-peer DiLoCo). These weights are certified version {cv.version} of the run: the
certificate chain verifies from genesis to this version and the weights hash to the state hash
its committee signed.

| | |
|---|---|
| run | `{m.name}` |
| run id | `{cv.run_id}` |
| version | {cv.version} |
| certificate hash | `{cv.cert_hash}` (sha256 of the certificate's canonical body) |
| state hash | `{cv.cert.body.state_hash}` |
| tokens trained | {ledger.total_tokens:,} (receipts of versions 1–{cv.version}) |
| planned | {plan} |
| data | `{m.data}` |
| seed | {m.seed} |
| inner steps per round | {m.inner_steps} |
| contributors | {len(ledger.entries)} |

## Contributors (tokens of merged deltas, from the certified receipts)

| rank | peer id | tokens | deltas merged |
|---|---|---|---|
{rows}

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(".")
tokenizer = AutoTokenizer.from_pretrained(".")
ids = tokenizer("Once upon a time", return_tensors="pt").input_ids  # <bos> first
print(tokenizer.decode(model.generate(ids, max_new_tokens=100)[0], skip_special_tokens=True))
```

or `p2pdiloco sample --model-dir . --prompt "Once upon a time"`.
"""
