"""Can this build follow a run's manifest? Checked before signing one and before joining one.

A manifest names rules that change the certified bytes (``RunManifest.rules``, the codec, the
outer step). A node that lacks one of them would merge differently from the committee and
never get a signature to match, so it must refuse the run up front with one clear line.
"""

from __future__ import annotations

from collections.abc import Mapping

from p2pdiloco.aggregate import RULES, get_rule
from p2pdiloco.choices import PARAMS_UPDATE_CODECS, SPARSE_CODECS, UPDATE_CODECS
from p2pdiloco.compress import CODECS
from p2pdiloco.core.roster import CommitteeInfo
from p2pdiloco.core.round_types import RoundParams
from p2pdiloco.core.trust import round_trusted, trust_progress
from p2pdiloco.core.views import backoff
from p2pdiloco.errors import UserError
from p2pdiloco.protocol.certificates import MAX_RECEIPTS
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.sync.certified import CertifiedState


class UnsupportedManifest(UserError):
    """The run needs a rule, parameter, codec or layout this p2pdiloco does not implement."""


def check_supported(manifest: RunManifest) -> None:
    """Raise UnsupportedManifest (one line: what this build lacks and what it has) unless this
    build can merge, decode and sync exactly as the manifest says.

    Checks: the aggregation rule is in ``p2pdiloco.aggregate.RULES`` and accepts the manifest's
    parameters; the codec is in ``p2pdiloco.compress.CODECS``; the update codec is a dense one
    (``p2pdiloco.choices.UPDATE_CODECS``, ADR 0029), or any codec for an update of the
    parameters' change (``rules.update_form`` "params", ADR 0064); with Streaming DiLoCo fragments
    (``sync.fragments``, ADR 0032), H a multiple of them and staleness 0.
    """
    rules = manifest.rules
    if rules.aggregation not in RULES:
        raise UnsupportedManifest(
            f"run {manifest.name!r} merges with aggregation rule {rules.aggregation!r}, which "
            f"this p2pdiloco lacks; it has {', '.join(RULES)}"
        )
    try:
        get_rule(rules.aggregation, **rules.aggregation_params)
    except ValueError as e:
        detail = " ".join(str(e).split())
        raise UnsupportedManifest(
            f"run {manifest.name!r} sets {rules.aggregation} parameters "
            f"{rules.aggregation_params} that this p2pdiloco refuses: {detail}"
        ) from None
    if manifest.compression not in CODECS:
        raise UnsupportedManifest(
            f"run {manifest.name!r} compresses deltas with codec {manifest.compression!r}, "
            f"which this p2pdiloco lacks; it has {', '.join(CODECS)}"
        )
    allowed = PARAMS_UPDATE_CODECS if rules.update_form == "params" else UPDATE_CODECS
    if rules.update_codec not in allowed:
        why = (
            "a sparse update of the gradient would need error feedback that followers cannot "
            'recompute; certify the parameters\' change instead (rules.update_form "params")'
            if rules.update_codec in SPARSE_CODECS
            else "this p2pdiloco lacks it"
        )
        raise UnsupportedManifest(
            f"run {manifest.name!r} certifies updates with codec {rules.update_codec!r}: {why}; "
            f"use one of {', '.join(allowed)}"
        )
    if rules.update_k is not None and rules.update_codec not in SPARSE_CODECS:
        raise UnsupportedManifest(
            f"run {manifest.name!r} sets update_k for codec {rules.update_codec!r}, which keeps "
            "every entry; update_k is for a sparse update codec"
        )
    fragments = manifest.outer.fragments
    if fragments > 1 and manifest.inner_steps % fragments:
        raise UnsupportedManifest(
            f"run {manifest.name!r} syncs {fragments} fragments every {manifest.inner_steps} "
            "inner steps; the steps must be a multiple of the fragments (a fragment is sent "
            "every H/P steps)"
        )
    if fragments > 1:  # each fragment holds at least one tensor (ADR 0032)
        from p2pdiloco.train.models import build_for_loading, param_state

        tensors = len(param_state(build_for_loading(manifest.model, device="meta")))
        if fragments > tensors:
            raise UnsupportedManifest(
                f"run {manifest.name!r} syncs {fragments} fragments, more than the {tensors} "
                f"tensors of {manifest.model}: a fragment holds at least one tensor"
            )
    if fragments > 1 and rules.staleness > 0:
        raise UnsupportedManifest(
            f"run {manifest.name!r} syncs {fragments} fragments with staleness "
            f"{rules.staleness}; fragments need staleness 0 (the round on version v syncs "
            "fragment v mod P, so a delta on an older version is another fragment's)"
        )


def round_params(
    run_id: str,
    manifest: RunManifest,
    base: CertifiedState,
    committee: CommitteeInfo,
    active_learners: int,
    now: float,
    locked: tuple[str, ...] | None = None,
    close_after: float | None = None,
    trusted_learners: int | None = None,
    max_inputs: int = MAX_RECEIPTS,
) -> RoundParams:
    """Every parameter of the round on the certified ``base``: the consensus ones from the
    signed manifest (its ``rules``, the token bound and H) and the base's certificate (who is
    trusted, ``core.trust``), the committee of the view, the learners alive (heartbeats, or
    the roster: live heartbeats lag at start-up; at least 1), how many of them are trusted
    (``core.trust.learners_awaited``; None: all) and the inputs this member holds at most
    (local: ``sync.intake.Intake.max_inputs``)."""
    trusted = round_trusted(manifest, base.cert)
    progress = None if trusted is None else trust_progress(manifest, base.cert)
    return params_of(
        run_id,
        manifest,
        base.version,
        trusted,
        committee,
        active_learners,
        now,
        locked,
        close_after,
        trusted_learners,
        progress,
        max_inputs,
    )


def params_of(
    run_id: str,
    manifest: RunManifest,
    version: int,
    trusted: frozenset[str] | None,
    committee: CommitteeInfo,
    active_learners: int,
    now: float,
    locked: tuple[str, ...] | None = None,
    close_after: float | None = None,
    trusted_learners: int | None = None,
    progress: Mapping[str, int] | None = None,
    max_inputs: int = MAX_RECEIPTS,
) -> RoundParams:
    """:func:`round_params` on its inputs (the base version and who is trusted after it), for
    drivers that keep no certificate bodies (the simulator, ``p2pdiloco.sim``)."""
    r, inner = manifest.rules, manifest.inner
    return RoundParams(
        run_id=run_id,
        version=version,
        committee=committee.members,
        quorum=committee.quorum,
        active_learners=max(1, active_learners),
        opened_at=now,
        grace=r.grace,
        min_fraction=r.min_quorum_fraction,
        staleness=r.staleness,
        max_tokens_per_step=inner.batch_size * inner.seq_len,
        max_steps=manifest.inner_steps,
        weight_cap=r.weight_cap,
        agree_timeout=r.agree_timeout * backoff(r, committee.view),
        linger=r.linger,
        locked=locked,
        close_after=close_after,
        trusted=trusted,
        probation_share=r.probation_share,
        probation_floor=0 if r.work is None else 1,
        trusted_learners=None if trusted_learners is None else max(1, trusted_learners),
        progress=progress,
        max_inputs=max_inputs,
        eval_tolerance=None if manifest.held_out is None else manifest.held_out.tolerance,
    )
