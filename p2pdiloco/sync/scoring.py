"""Work scoring (ADR 0062): a delta counts only if it shows work on the learner's own data.

With ``SyncRules.work`` set, a learner training from certified version v reads the rows
assigned to it for v, a pure function of the run seed, its identity and v
(``train.data.assigned_rows``). The committee scores a delta Δ on base v as Templar's Gauntlet
does, on a few seeded batches of those rows: the loss at the certified parameters θ, at θ − Δ
(where the learner ended up) and at θ − Δ_r·|Δ|/|Δ_r| for ``REFERENCES`` other trusted deltas
of the round (ADR 0065), none of which trained on these rows, each scaled to Δ's norm so that a
learner that trained fewer steps than its references is not held to their larger step:

    advantage = min(own loss drop, own loss drop − the references' mean drop on the same rows)

Honest training lowers the loss on the rows trained, and more than a peer's training of as many
steps on other rows does. Comparing on the same rows cancels how easy those rows are to
improve, which set apart rows never seen (ADR 0062's first statistic) cannot: at 20 own rows a
replay of the last update passed that one 37.5 % of the time and noise 29.9 %, this one 4.2 %
and 3.9 %, while honest deltas pass 97.5 % against 93.8 % (``bench/scoring_power.py``). Without a reference (no other trusted delta in
the round) the other side is as many rows not assigned to the sender, scored at θ − Δ alike.
A delta that holds no work of its sender (the public certified update replayed or scaled,
another learner's delta, noise) shows an advantage of ~0 or below, and unless it exceeds
``margin`` it earns no receipt, no token credit, so no trust and no seat
(``sync.aggregator``: refused if probationary, merged uncredited if trusted).

Two screens run first, cheap and exact on the decoded deltas (float64 sums by the fixed tree of
``aggregate.exact``, so every syncer draws the same line): a delta whose cosine similarity to
the last certified update reaches ``max_cosine`` replays it and is refused; inputs that close to
one another are a group of copies, every one of them is scored, and only the one with the best
advantage above the margin may count. A copy of an honest delta thus earns nothing (it shows no
advantage on its sender's rows), and the original keeps its receipt whatever the input order.

Scoring costs (2 + ``REFERENCES``) × ``batches`` forward passes of at most ``rows`` rows per
delta (4 × without references); ``max_scored`` bounds it per round: probationary deltas first,
then trusted ones in an order seeded by the version. A probationary delta left unscored is
refused; a trusted one is merged as before.

Shapes: M inputs, D parameters (a RowSet's virtual rows); B rows per batch, S = seq_len + 1.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from p2pdiloco.aggregate.rows import RowSet
from p2pdiloco.protocol.records import RunManifest, WorkScoring
from p2pdiloco.sync.stopping import StopFlag
from p2pdiloco.train.data import PackedCorpus, assigned_rows, sample_rows
from p2pdiloco.train.inner import evaluate, row_losses
from p2pdiloco.train.learner import data_seed
from p2pdiloco.train.models import build_for_loading, param_state

# Other trusted deltas a delta is compared with on its own rows (ADR 0065): 2 cost what the
# rows not assigned cost before, and refused noise and replays as well as all 7 of a round of 8.
REFERENCES = 2

# A reference delta and the factor that scales it to the scored delta's norm.
Reference = tuple[Mapping[str, torch.Tensor], float]
# (peer id, its delta by tensor name, references, the version whose rows it trained on or
# None for the round's base, the submission's digest) → its score (nats of advantage, or
# standard errors for the z test); the merge's view of a scorer.
ScoreFn = Callable[[str, Mapping[str, torch.Tensor], Sequence[Reference], int | None, str], float]
# (peer id, certified version) → (rows assigned to it for that version, every other row).
RowsOf = Callable[[str, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class WorkCheck:
    """What the merge needs to check work: the run's rules, a scorer bound to the round's base
    (:meth:`WorkScorer.bind`), the decoded last certified update (None: not held here, that
    screen is skipped), the seed of the scoring order, whether trust in the round is earned
    (``core.trust.trusted_peers`` is not None: the genesis committee and identities with
    scored work) rather than open to everyone, as in a young run before its first receipt,
    and the run's founders."""

    rules: WorkScoring
    score: ScoreFn
    last_update: Mapping[str, torch.Tensor] | None = None
    seed: int = 0
    trust_earned: bool = False
    # The run's first roster (its genesis committee, or the creator alone): under the z test,
    # while trust is open and nothing shows work, as in a run's first versions where no
    # stretch can (ADR 0070), their deltas are merged uncredited and everyone else's refused.
    founders: frozenset[str] = frozenset()


def copies(
    deltas: RowSet, rows: Sequence[int], last: Sequence[torch.Tensor] | None, max_cosine: float
) -> tuple[dict[int, str], dict[int, int]]:
    """Copies among ``rows``: those of the last certified update (``last``: its tensors in the
    deltas' order), row → reason; and the groups of rows that copy one another (joined
    transitively), row → its group's first row, for the rows of groups of two or more.
    A copy is a cosine similarity of at least ``max_cosine``."""
    m = len(rows)
    if not m:
        return {}, {}
    if last is not None:
        ref = RowSet([*([deltas.rows[j] for j in rows]), list(last)])
        dist, norms = ref.pairwise_sq_dists(list(range(m + 1))), ref.sq_norms(list(range(m + 1)))
    else:
        dist, norms = deltas.pairwise_sq_dists(list(rows)), deltas.sq_norms(list(rows))
    replays = {
        rows[a]: "replays the last certified update"
        for a in range(m)
        if last is not None and _cosine(norms[a], norms[m], dist[a][m]) >= max_cosine
    }
    root = list(range(m))
    for a in range(m):
        for b in range(a):
            if _cosine(norms[a], norms[b], dist[a][b]) >= max_cosine:
                ra, rb = _find(root, a), _find(root, b)
                root[max(ra, rb)] = min(ra, rb)
    sizes: dict[int, int] = {}
    for a in range(m):
        sizes[_find(root, a)] = sizes.get(_find(root, a), 0) + 1
    groups = {rows[a]: rows[_find(root, a)] for a in range(m) if sizes[_find(root, a)] > 1}
    return replays, groups


def _find(root: list[int], a: int) -> int:
    while root[a] != a:
        a = root[a]
    return a


def _cosine(aa: float, bb: float, dd: float) -> float:
    if aa <= 0 or bb <= 0:
        return 1.0 if aa == bb else 0.0  # two zero deltas are one copy
    return (aa + bb - dd) / (2 * math.sqrt(aa * bb))


def gap_z(own_N: torch.Tensor, other_N: torch.Tensor) -> float:
    """Welch's z of per-row loss drops on a delta's own rows (``own_N``) against rows not
    assigned to its sender (``other_N``): how many standard errors its own rows gained more
    (ADR 0070). A delta that holds no training on its own rows (a replay, a copy, noise,
    however scaled) scores about N(0, 1) whatever its size or age: the threshold ``z_min`` is
    its false credit rate (3.0: 0.13 %). Fewer than two rows a side shows nothing (−inf)."""
    own, other = own_N.double(), other_N.double()
    if own.numel() < 2 or other.numel() < 2:
        return -math.inf
    se = math.sqrt(float(own.var()) / own.numel() + float(other.var()) / other.numel())
    gap = float(own.mean()) - float(other.mean())
    return gap / se if se > 0 else (0.0 if gap == 0 else math.copysign(math.inf, gap))


def references(
    peers: Sequence[str], trusted: Sequence[bool], at: int, seed: int, count: int = REFERENCES
) -> list[int]:
    """Positions of ``peers`` that the delta at ``at`` is compared with (ADR 0065): ``count``
    trusted ones other than itself, in an order seeded by (``seed``, its peer, theirs), so
    every syncer picks the same and no sender chooses its own."""

    def key(i: int) -> bytes:
        return hashlib.sha256(f"{seed}/{peers[at]}/{peers[i]}".encode()).digest()

    return sorted((i for i in range(len(peers)) if trusted[i] and i != at), key=key)[:count]


def scoring_order(
    peers: Sequence[str], trusted: Sequence[bool], seed: int, first: Collection[int] = ()
) -> list[int]:
    """Positions of ``peers`` in the order they are scored: those in ``first`` (copies), then
    probationary ones, then trusted ones, each in an order seeded by ``seed`` (every syncer
    scores the same)."""

    def key(i: int) -> tuple[bool, bool, bytes]:
        digest = hashlib.sha256(f"{seed}/{peers[i]}".encode()).digest()
        return i not in first, trusted[i], digest

    return sorted(range(len(peers)), key=key)


class WorkScorer:
    """Scores deltas with a model of the run on its corpus' train rows ``train_NS``.

    ``rows_of(peer, version)`` gives the rows assigned to a learner for its stretch from
    ``version`` and the rows it was not (default: ``train.data.assigned_rows`` of its data seed
    with H = ``steps`` and ``batch_size``, as a network learner reads them). One model is kept
    and reloaded per delta: memory is one model more than the merge's."""

    def __init__(
        self,
        model: torch.nn.Module | Callable[[], torch.nn.Module],
        train_NS: torch.Tensor,
        rules: WorkScoring,
        run_seed: int,
        rows_of: RowsOf | None = None,
        *,
        steps: int = 1,
        batch_size: int = 1,
    ) -> None:
        self._model = model  # or what builds it, on the first delta scored
        self.train_NS, self.rules, self.run_seed = train_NS, rules, run_seed
        n = int(train_NS.shape[0])

        def assigned(peer: str, version: int) -> tuple[torch.Tensor, torch.Tensor]:
            seed = data_seed(run_seed, peer)
            return assigned_rows(n, seed=seed, version=version, steps=steps, batch_size=batch_size)

        self.rows_of = rows_of or assigned
        self.scored = 0  # deltas scored so far (the cost bench reads it)
        # Set when the node stops: a score under way raises MergeStopped at its next batch.
        self._stopping = StopFlag()

    def stop(self) -> None:
        """Abandon any score under way, and every later one (the node is stopping)."""
        self._stopping.stop()

    @property
    def model(self) -> torch.nn.Module:
        if not isinstance(self._model, torch.nn.Module):
            self._model = self._model()
        return self._model

    def bind(self, base: Mapping[str, torch.Tensor], version: int) -> ScoreFn:
        """A scorer of deltas on ``base``, the certified parameters of ``version``: batches
        are seeded by (run seed, version, peer), so every syncer scores on the same rows.
        With ``references`` (each scaled by its factor), the other side is their mean loss drop
        on the same own rows; without, the delta's own drop on as many rows not assigned to the
        sender."""

        def score(
            peer: str,
            delta: Mapping[str, torch.Tensor],
            references: Sequence[Reference] = (),
            rows_version: int | None = None,
            digest: str = "",
        ) -> float:
            at = version if rows_version is None else rows_version
            if self.rules.z_min is not None:  # rows drawn after the delta is sent (ADR 0070)
                return self._z(base, delta, *self.batches(peer, at, digest))
            own, other = self.batches(peer, at)
            self._load(base, None)
            before = evaluate(self.model, own, self._stopping.check)
            self._load(base, delta)
            own_drop = before - evaluate(self.model, own, self._stopping.check)
            if references:
                drops = []
                for ref, scale in references:
                    self._load(base, ref, scale)
                    drops.append(before - evaluate(self.model, own, self._stopping.check))
                other_drop = math.fsum(drops) / len(drops)
            else:
                after_other = evaluate(self.model, other, self._stopping.check)
                self._load(base, None)
                other_drop = evaluate(self.model, other, self._stopping.check) - after_other
            self.scored += 1
            return min(own_drop, own_drop - other_drop)

        return score

    def _z(
        self,
        base: Mapping[str, torch.Tensor],
        delta: Mapping[str, torch.Tensor],
        own: list[torch.Tensor],
        other: list[torch.Tensor],
    ) -> float:
        """The z test (ADR 0070): Welch's z of the delta's per-row loss drops on its own rows
        against rows not assigned to its sender, both at the round's base."""
        self._load(base, None)
        check = self._stopping.check
        own_before = row_losses(self.model, own, check)
        other_before = row_losses(self.model, other, check)
        self._load(base, delta)
        own_drop = own_before - row_losses(self.model, own, check)
        other_drop = other_before - row_losses(self.model, other, check)
        self.scored += 1
        return gap_z(own_drop, other_drop)

    def batches(
        self, peer: str, version: int, digest: str = ""
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The seeded [B, S] batches of ``peer``'s own rows (all of them when fewer than
        ``batches`` × ``rows``) and of as many rows not assigned to it. With the submission's
        ``digest`` in the seed (the z test, ADR 0070) a sender cannot know before it sends
        which of its rows are scored, so training only those does not pass for the stretch."""
        r = self.rules
        own_N, other_N = self.rows_of(peer, version)
        count = r.batches * r.rows
        parts: tuple[object, ...] = (self.run_seed, version, peer, *((digest,) if digest else ()))
        own = sample_rows(own_N, count, "own", *parts)
        other = sample_rows(other_N, count, "other", *parts)
        return (
            list(torch.split(self.train_NS[own], r.rows)),
            list(torch.split(self.train_NS[other], r.rows)),
        )

    @torch.no_grad()
    def _load(
        self,
        base: Mapping[str, torch.Tensor],
        delta: Mapping[str, torch.Tensor] | None,
        scale: float = 1.0,
    ) -> None:
        for n, p in param_state(self.model).items():
            t = base[n].to(p.device, torch.float32)
            if delta is not None and n in delta:
                d = delta[n].to(p.device, torch.float32)
                t = t - (d if scale == 1.0 else d * scale)
            p.copy_(t.to(p.dtype))


def work_scorer(manifest: RunManifest, corpus: PackedCorpus | None) -> WorkScorer | None:
    """A node's scorer for ``manifest``'s run, None when it scores no work or the node holds
    no corpus (then it cannot merge such a run's rounds: ``SyncService``)."""
    if manifest.rules.work is None or corpus is None:
        return None
    return WorkScorer(
        lambda: build_for_loading(manifest.model),  # a syncer's first merge builds it
        corpus.train_NS,
        manifest.rules.work,
        manifest.seed,
        steps=manifest.inner_steps,
        batch_size=manifest.inner.batch_size,
    )
