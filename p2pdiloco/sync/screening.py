"""How one syncer's round screens a submission header before holding it (``SyncerRound``).

The checks, in order: the run; a digest dropped earlier (its code again); the phase (after the
close only fetched members of the agreed set pass); the base version (newer than certified, or
older than the staleness allows: STALE, and the driver fast-forwards the learner); the token
claim (steps × batch × seq_len); a duplicate digest; then, for a learner's own copy only, one
submission per learner, ``max_inputs`` and the probationary room (BUSY).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.sync.round_types import Phase, Submission

if TYPE_CHECKING:
    from p2pdiloco.sync.round import SyncerRound

Refusal = tuple[Reason, str]


def screen(rnd: SyncerRound, sub: Submission, allow_after_close: bool = False) -> Refusal | None:
    """Why ``rnd`` refuses ``sub`` (code and one line), or None to hold it.
    ``allow_after_close``: a fetched member of the agreed set, past the close."""
    p = rnd.params
    if sub.run_id != p.run_id:
        return Reason.WRONG_RUN, "submission for another run"
    if sub.digest in rnd.dropped:
        return rnd.dropped[sub.digest], "submission was dropped from this round earlier"
    if rnd.phase is not Phase.COLLECTING and not allow_after_close:
        return Reason.ROUND_CLOSED, f"round for version {p.version + 1} is already closed"
    if sub.base_version > p.version:
        text = f"base version {sub.base_version} is newer than the certified {p.version}"
        return Reason.BASE_TOO_NEW, text
    if sub.base_version < p.version - p.staleness:
        text = f"stale: base version {sub.base_version} is older than {p.version - p.staleness}"
        return Reason.STALE, text
    if sub.steps < 1 or sub.tokens < 1:
        return Reason.BAD_CLAIM, "a submission must report at least one step and one token"
    if sub.tokens > sub.steps * p.max_tokens_per_step:
        text = (
            f"token claim {sub.tokens} exceeds steps × batch × seq_len "
            f"({sub.steps} × {p.max_tokens_per_step})"
        )
        return Reason.BAD_CLAIM, text
    if sub.digest in rnd.accepted:
        return Reason.DUPLICATE, "duplicate submission"
    if allow_after_close:
        return None
    if sub.peer_id in rnd.by_peer:
        return Reason.DUPLICATE, "a second submission from the same learner in one round"
    if len(rnd.accepted) >= p.max_inputs:
        return Reason.BUSY, f"round already holds {p.max_inputs} submissions"
    if not p.is_trusted(sub.peer_id):
        room = max(1, int(p.max_inputs * p.probation_share))
        if rnd.probationary >= room:
            return Reason.BUSY, f"round already holds {room} probationary submissions"
    return None
