"""Checked claims: a steps claim above one delta's worth is clipped, weighed and credited as such."""

from __future__ import annotations

import pytest

from p2pdiloco.core.round import Clipped, RoundParams, Submission, SyncerRound
from p2pdiloco.core.weights import plausible_claim

H, TOKENS_PER_STEP = 20, 128


def test_plausible_claim_keeps_honest_claims_and_clips_inflated_ones() -> None:
    assert plausible_claim(20, 2560, H) == (20, 2560)
    assert plausible_claim(5, 640, H) == (5, 640)  # fewer steps than H: as claimed
    assert plausible_claim(10**6, 10**6 * TOKENS_PER_STEP, H) == (H, H * TOKENS_PER_STEP)
    assert plausible_claim(10**9, 1, H) == (H, 1)  # tokens never round down to zero
    with pytest.raises(ValueError):
        plausible_claim(1, 1, 0)


def _round() -> SyncerRound:
    p = RoundParams(
        run_id="run",
        version=3,
        committee=("s0",),
        quorum=1,
        active_learners=8,
        opened_at=0.0,
        max_tokens_per_step=TOKENS_PER_STEP,
        max_steps=H,
        weight_cap=0.25,
    )
    return SyncerRound(p, "s0")


def test_a_header_claiming_a_million_steps_is_clipped_reported_and_never_outweighs_the_cap() -> (
    None
):
    rnd = _round()
    liar = Submission("liar", "run", 3, 10**6, 10**6 * TOKENS_PER_STEP, "d00")
    actions = rnd.on_submission(liar, now=1.0)
    clips = [a for a in actions if isinstance(a, Clipped)]
    assert clips == [
        Clipped("liar", "d00", (10**6, 10**6 * TOKENS_PER_STEP), (H, H * TOKENS_PER_STEP))
    ]
    assert (rnd.accepted["d00"].steps, rnd.accepted["d00"].tokens) == (H, H * TOKENS_PER_STEP)
    honest = [
        Submission(f"h{i}", "run", 3, H, H * TOKENS_PER_STEP, f"d{i:02d}") for i in range(1, 5)
    ]
    for s in honest:
        assert not [a for a in rnd.on_submission(s, now=1.0) if isinstance(a, Clipped)]
    digests = tuple(sorted(rnd.accepted))
    weights = dict(zip(digests, rnd.weights(digests), strict=True))
    # Clipped to H the liar weighs exactly what each honest learner does: 1/5 of the merge.
    assert weights["d00"] == pytest.approx(sum(weights.values()) / 5)
    assert weights["d00"] <= 0.25 * sum(weights.values()) + 1e-12


def test_the_clip_is_the_same_for_a_fetched_copy() -> None:
    # A fellow syncer that fetches the liar's submission must count the same clipped claim.
    a, b = _round(), _round()
    liar = Submission("liar", "run", 3, 10**6, 10**6 * TOKENS_PER_STEP, "d00")
    a.on_submission(liar, now=1.0)
    b.on_proposal("s0", ("d00",), now=1.0)  # b lacks d00: it fetches it
    b.on_fetched(liar)
    assert a.accepted["d00"] == b.accepted["d00"]
    assert b.accepted["d00"].steps == H
