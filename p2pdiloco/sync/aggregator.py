"""The merge: agreed deltas → screened → robust rule → outer step → new state. The only one.

The syncer service runs it on a round's agreed submissions (in a worker thread), the simulator
on each fragment's deltas, the tests directly. Pure tensor work, no IO. Every honest syncer that
merges the same inputs (same deltas, same weights, same order) from the same certified state
gets a bit-identical result (the rules and the outer step are element-wise or fixed-order;
ADR 0005), which is what lets their signatures over the state hash match.

Shapes: M inputs, D parameters (the tensors named in ``params``, flattened in sorted-name order).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from p2pdiloco.aggregate import get_rule
from p2pdiloco.aggregate.base import AggregationRule, check_weights
from p2pdiloco.aggregate.clipping import judge_norms
from p2pdiloco.aggregate.exact import SqSums
from p2pdiloco.aggregate.rows import RowSet
from p2pdiloco.compress.base import Codec, Encoded
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.sync.clones import fold_clones
from p2pdiloco.sync.scoring import WorkCheck, copies, references, scoring_order
from p2pdiloco.train.outer import OuterConfig, outer_update_, params_step_

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeInput:
    """One agreed submission, decoded: its id, its sender, its delta per tensor, its weight.

    ``weight`` comes from ``core.weights.merge_weights`` (tokens / (1 + lag), capped at
    ``SyncRules.weight_cap``), computed over the whole input set in sorted-id order.
    """

    digest: str
    peer_id: str
    delta: Mapping[str, torch.Tensor]  # at least the names being merged; others are ignored
    weight: float
    trusted: bool = True  # its norm anchors screening (core.trust: probationary ones do not)
    # With work scoring: the version whose assigned rows it trained on (ADR 0066); None: the
    # round's base.
    rows_version: int | None = None


@dataclass
class MergeResult:
    params: dict[str, torch.Tensor]  # the merged names, float32, on the device of ``params``
    momentum: dict[str, torch.Tensor]  # outer Nesterov buffers of the merged names
    accepted: list[str]  # digests merged, in input order
    rejected: dict[str, str] = field(default_factory=dict)  # digest → screening reason
    rule: str = ""  # the rule actually applied (a fallback is named here)
    # Accepted digests merged as another one's copy (``sync.clones``, ADR 0036): digest → the
    # digest of its group's row that the rule saw. They are in ``accepted`` too.
    folded: dict[str, str] = field(default_factory=dict)
    # The merged pseudo-gradient g encoded per tensor (sorted names) with the update codec, when
    # one was given: the outer step applied decode(encode(g)), which is what learners repeat.
    # With a residual (ADR 0064): the parameters' change, sent with error feedback.
    update: dict[str, Encoded] = field(default_factory=dict)
    # The error-feedback residual of the update per merged name, when one was given.
    residual: dict[str, torch.Tensor] = field(default_factory=dict)
    # Accepted digests merged without credit (ADR 0065): trusted inputs whose work scoring
    # showed no advantage on their own data. Their receipts credit 0 tokens.
    uncredited: list[str] = field(default_factory=list)


class MergeError(ValueError):
    """No merge this round: screening rejected every delta (or there were none).

    ``rejected`` maps each input's digest to its reason. The round certifies nothing; the
    certified state stays as it was.
    """

    def __init__(self, message: str, rejected: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.rejected = dict(rejected or {})


def merge_round(
    params: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    inputs: Sequence[MergeInput],
    *,
    rules: SyncRules,
    outer: OuterConfig,
    update_codec: Codec | None = None,
    residual: Mapping[str, torch.Tensor] | None = None,
    work: WorkCheck | None = None,
) -> MergeResult:
    """The next state of the tensors named in ``params`` (left untouched, as is ``momentum``).

    Merges only the names in ``params``, so a caller may pass one fragment. Each input's delta
    must hold every such name; a missing tensor or a wrong shape rejects that input, like
    screening does (finite, size, norm ≤ ``rules.screen_norm_factor`` × the median norm of the
    trusted inputs, so probationary ones cannot move it, and a probationary delta must not point
    away from the trusted inputs' mean: ``core.trust``). With ``rules.clone_factor`` set, copies
    of one vector (``sync.clones``) count as one row: the first of each group, with its weight;
    the others stay accepted and are named in ``MergeResult.folded``. The rule
    ``rules.aggregation`` merges the rest with the inputs' weights. If fewer remain than the
    rule needs, the coordinate median is used instead (named in ``MergeResult.rule``), so a
    round that closed with few learners still produces a state. A name without a momentum
    buffer starts from zero.

    With ``update_codec``, each tensor's merged g is kept until its last window, encoded
    (``MergeResult.update``), and the outer step applies the decoded values instead (ADR 0029):
    the merge then also holds one tensor's g and its encoding. Without it, g is applied as
    merged, window by window. With ``residual`` too (the committee's error feedback, ADR 0064;
    a name without one starts from zero), the update is the parameters' change instead
    (``train.outer.params_step_``) and ``MergeResult.residual`` holds the new residuals.

    Raises MergeError if no input survives screening, and ValueError from ``get_rule`` for rule
    parameters the rule refuses (``sync.rules.check_supported`` catches those up front).
    """
    names = sorted(params)
    chosen = get_rule(rules.aggregation, **rules.aggregation_params)
    rows, rejected = _well_shaped(inputs, params, names)
    # The deltas stay where they are: never one [M, D] copy (RowSet hands out column windows).
    deltas = RowSet([[inputs[i].delta[n] for n in names] for i in rows])
    trusted = [inputs[i].trusted for i in rows]
    kept, reasons = _screen(deltas, trusted, rules.screen_norm_factor)
    if work is not None:  # a replay is named so, whichever screen refused it first
        reasons.update(_replays(deltas, sorted(reasons), names, work))
    rejected.update({inputs[rows[j]].digest: reason for j, reason in reasons.items()})
    unshown: list[int] = []  # trusted rows merged without credit
    if work is not None:
        kept, unworked, unshown = _check_work(inputs, rows, deltas, kept, trusted, names, work)
        rejected.update({inputs[rows[j]].digest: reason for j, reason in unworked.items()})
    if not kept:
        raise MergeError("screening rejected every delta of the round", rejected)
    into = _fold(deltas, kept, trusted, rules.clone_factor)
    if work is not None:  # one receipt per group of copies: its row's
        for j, r in into.items():
            rejected[inputs[rows[j]].digest] = f"folded into {inputs[rows[r]].digest[:12]}"
    voters = [j for j in kept if j not in into]  # one row per group of clones
    chosen, applied = _rule_or_fallback(chosen, rules.aggregation, len(voters))
    weights = check_weights([inputs[rows[j]].weight for j in voters], len(voters))
    new_params, new_momentum = _fresh_state(params, momentum, names)
    feedback = _fresh_residual(residual, new_params, update_codec)
    update = _outer_step(
        deltas, voters, weights, chosen, new_params, new_momentum, outer, update_codec, feedback
    )
    order = {inp.digest: k for k, inp in enumerate(inputs)}
    return MergeResult(
        params=new_params,
        momentum=new_momentum,
        accepted=[inputs[rows[j]].digest for j in kept if work is None or j not in into],
        rejected=dict(sorted(rejected.items(), key=lambda kv: order[kv[0]])),
        rule=applied,
        folded={
            inputs[rows[j]].digest: inputs[rows[r]].digest for j, r in into.items() if work is None
        },
        update={n: update[n] for n in names if n in update},
        residual=feedback or {},
        uncredited=[inputs[rows[j]].digest for j in unshown if j not in into],
    )


def _well_shaped(
    inputs: Sequence[MergeInput], params: Mapping[str, torch.Tensor], names: list[str]
) -> tuple[list[int], dict[str, str]]:
    """The indices of the inputs whose delta holds every tensor of ``names`` in its shape in
    ``params``, and digest → reason for the others. Raises MergeError if none does."""
    rows: list[int] = []
    rejected: dict[str, str] = {}
    for i, inp in enumerate(inputs):
        reason = _shape_mismatch(inp.delta, params, names)
        if reason:
            rejected[inp.digest] = reason
        else:
            rows.append(i)
    if not rows:
        raise MergeError("no delta of the round has the model's tensors", rejected)
    return rows, rejected


def _screen(
    deltas: RowSet, trusted: list[bool], norm_factor: float | None
) -> tuple[list[int], dict[int, str]]:
    """Screening: the rows kept (in row order), and row → reason for the others. A row is
    dropped if it is not finite, if its norm exceeds ``norm_factor`` (None: no bound) × the
    median norm of the trusted rows (``aggregate.clipping.judge_norms``; every row anchors it
    when all are trusted), or if it is probationary and points away from the trusted rows'
    mean (:func:`_away_from_trusted`)."""
    everyone = list(range(deltas.m))
    anchors = [j for j in everyone if trusted[j]]
    verdict = judge_norms(
        deltas.m,
        dict(zip(everyone, deltas.sq_norms(everyone), strict=True)),
        {},
        norm_factor,
        anchors if len(anchors) < deltas.m else None,
    )
    away = _away_from_trusted(deltas, verdict.accepted, trusted)
    kept = [j for j in verdict.accepted if j not in away]
    return kept, {**verdict.rejected, **away}


def _last_update(names: list[str], work: WorkCheck) -> list[torch.Tensor] | None:
    """The last certified update's tensors in ``names`` order; None when not held whole."""
    if work.last_update is None or any(n not in work.last_update for n in names):
        return None
    return [work.last_update[n] for n in names]


def _replays(deltas: RowSet, rows: list[int], names: list[str], work: WorkCheck) -> dict[int, str]:
    """Of ``rows``, those that replay the last certified update: row → reason."""
    last = _last_update(names, work)
    return copies(deltas, rows, last, work.rules.max_cosine)[0] if last is not None else {}


def _check_work(
    inputs: Sequence[MergeInput],
    rows: list[int],
    deltas: RowSet,
    kept: list[int],
    trusted: list[bool],
    names: list[str],
    work: WorkCheck,
) -> tuple[list[int], dict[int, str], list[int]]:
    """Work scoring (``sync.scoring``, ADR 0062): of ``kept``, the rows that replay the last
    certified update are refused; then the copies of one another, the probationary rows and
    the trusted ones are scored in that order, up to ``max_scored`` (copies always). A
    probationary row is refused unless its advantage on its sender's own data exceeds
    ``margin``; a trusted row that shows no such advantage is merged without credit (ADR 0065:
    at a few hundred own rows an honest delta's advantage is lost in the noise now and then,
    and its work still belongs in the model). When no row of the
    round shows work, those trusted rows are still merged uncredited where trust is earned
    (``work.trust_earned``, ADR 0066: a lone learner's round must not stall on one unlucky
    score), and refused while trust is open to everyone (a round of free riders only
    certifies nothing; under the z test the founders' are merged uncredited, ADR 0070). Of a
    group of copies only the best row that shows work stays, the others refused as its copies;
    of a group in which none does, the trusted rows are merged uncredited (ADR 0074). A
    probationary row left unscored is refused. Returns the rows kept
    (in row order), row → reason for the refused ones, and the kept rows merged uncredited."""
    r = work.rules
    refused, groups = copies(deltas, kept, _last_update(names, work), r.max_cosine)
    rest = [j for j in kept if j not in refused]
    peers = [inputs[rows[j]].peer_id for j in rest]
    first = {at for at, j in enumerate(rest) if j in groups}
    order = scoring_order(peers, [trusted[j] for j in rest], work.seed, first)
    # References: trusted rows that copy no other input (a copy would compare a delta with
    # itself, or lend one sender's work to another).
    ref_ok = [trusted[j] and j not in groups for j in rest]
    norms = dict(zip(rest, deltas.sq_norms(rest), strict=True))  # fixed-tree float64 sums
    best: dict[int, tuple[float, int]] = {}  # group → (best advantage, its row)
    # Under the z test, before anyone earned trust, only founders' deltas can be merged (ADR
    # 0070/0071): a newcomer's dashboard says so rather than only "rejected".
    young = r.z_min is not None and not work.trust_earned and bool(work.founders)
    unshown_reason = "no advantage on its own data" + (
        " (young run: founders only)" if young else ""
    )
    unshown: list[int] = []
    for k, at in enumerate(order):
        j = rest[at]
        if k >= r.max_scored and at not in first:
            if not trusted[j]:
                refused[j] = "not scored this round (probationary, over max_scored)"
            continue
        delta = {n: inputs[rows[j]].delta[n] for n in names}
        refs = [  # the paired score's (ADR 0065); the z test needs none (ADR 0070)
            ({n: inputs[rows[rest[i]]].delta[n] for n in names}, _scale_to(norms, rest[i], j))
            for i in (references(peers, ref_ok, at, work.seed) if r.z_min is None else [])
        ]
        advantage = work.score(
            peers[at], delta, refs, inputs[rows[j]].rows_version, inputs[rows[j]].digest
        )
        log.info(
            "work score of %s (%s, rows of version %s): %+.4f %s",
            inputs[rows[j]].digest[:12],
            "trusted" if trusted[j] else "probationary",
            inputs[rows[j]].rows_version,
            advantage,
            f"nats against {len(refs)} references"
            if r.z_min is None
            else f"standard errors (passes at {r.z_min:g})",
        )
        if not advantage > r.pass_mark and trusted[j]:
            unshown.append(j)  # a copy among them stands only while its group shows no work
        elif not advantage > r.pass_mark:
            # No figure in the text: it enters the certificate body, and a loss is not
            # bit-exact across machines the way the fixed-tree sums of the norm screen are.
            refused[j] = unshown_reason
        elif j in groups:
            g = groups[j]
            if g in best and best[g][0] >= advantage:
                refused[j] = f"copies input {inputs[rows[best[g][1]]].digest[:12]}"
                continue
            if g in best:
                refused[best[g][1]] = f"copies input {inputs[rows[j]].digest[:12]}"
            best[g] = (advantage, j)
    # A group of copies in which one showed work counts that one alone; one in which none did is
    # merged uncredited as its trusted members (clone folding makes them one row, ADR 0036):
    # refusing them all would let a copier refuse an honest delta wherever the test is weak,
    # and in a young run refuse the founder's only delta and certify nothing (ADR 0074).
    for j in unshown:
        if j in groups and groups[j] in best:
            refused[j] = f"copies input {inputs[rows[best[groups[j]][1]]].digest[:12]}"
    unshown = [j for j in unshown if j not in refused]
    if not work.trust_earned and not [j for j in kept if j not in refused and j not in unshown]:
        # Nothing showed work while everyone counts as trusted (a young run before its first
        # receipt): the round certifies nothing, or free riders alone could certify a version.
        # Under the z test no stretch of a run's first versions can show work (ADR 0070): the
        # founders' deltas are merged uncredited, so the run starts; no one earns a receipt.
        founders = work.founders if r.z_min is not None else frozenset()
        fresh = [j for j in unshown if inputs[rows[j]].peer_id not in founders]
        refused.update(dict.fromkeys(fresh, unshown_reason))
        unshown = [j for j in unshown if j not in fresh]
    return [j for j in kept if j not in refused], refused, sorted(unshown)


def _scale_to(sq_norms: Mapping[int, float], ref: int, row: int) -> float:
    """The factor that scales row ``ref`` to row ``row``'s norm (1 for a zero row)."""
    a, b = sq_norms[row], sq_norms[ref]
    return math.sqrt(a / b) if a > 0 and b > 0 else 1.0


def _fold(
    deltas: RowSet, kept: list[int], trusted: list[bool], clone_factor: float | None
) -> dict[int, int]:
    """Copies of one vector among ``kept`` (``sync.clones``, ADR 0036): row → the row of its
    group that stands for it (the group's first); {} when the run does not fold clones."""
    if clone_factor is None:
        return {}
    return fold_clones(deltas, kept, [j for j in kept if trusted[j]], clone_factor)


def _rule_or_fallback(rule: AggregationRule, name: str, voters: int) -> tuple[AggregationRule, str]:
    """The rule to apply to ``voters`` rows and how the certificate names it: the run's rule,
    or the coordinate median when fewer rows remain than the run's rule needs, so a round
    that closed with few learners still produces a state."""
    if voters < rule.min_learners:
        return get_rule("median"), f"median (fallback from {name})"
    return rule, name


def _fresh_state(
    params: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor], names: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Float32 copies of the merged names' parameters and momentum buffers, which the outer
    step updates in place (the caller's stay untouched); a name without a buffer starts from
    zero."""
    new_params = {n: params[n].detach().float().clone() for n in names}
    new_momentum = {
        n: momentum[n].detach().float().clone() if n in momentum else torch.zeros_like(p)
        for n, p in new_params.items()
    }
    return new_params, new_momentum


def _fresh_residual(
    residual: Mapping[str, torch.Tensor] | None,
    new_params: Mapping[str, torch.Tensor],
    update_codec: Codec | None,
) -> dict[str, torch.Tensor] | None:
    """Float32 copies of the merged names' error-feedback residuals (zero where none is held),
    which the params step updates in place; None without a residual (the gradient update).
    Raises ValueError for a residual without an update codec to feed back through."""
    if residual is None:
        return None
    if update_codec is None:
        raise ValueError("error feedback needs an update codec")
    return {
        n: residual[n].detach().float().clone() if n in residual else torch.zeros_like(p)
        for n, p in new_params.items()
    }


def _outer_step(
    deltas: RowSet,
    voters: list[int],
    weights: list[float] | None,
    chosen: AggregationRule,
    new_params: dict[str, torch.Tensor],
    new_momentum: dict[str, torch.Tensor],
    outer: OuterConfig,
    update_codec: Codec | None,
    residual: dict[str, torch.Tensor] | None = None,
) -> dict[str, Encoded]:
    """Merge the ``voters`` rows with ``chosen`` and apply the outer step to ``new_params``
    and ``new_momentum`` in place, window by window of columns for a coordinate-wise rule (the
    merge then holds the M deltas, the new state and one window), in one window of width D
    for the others. With ``update_codec``, each tensor's merged g is kept until its last
    window, encoded, and the step applies the decoded values; returns those encodings by
    name ({} without a codec). With ``residual``, each tensor's step is sent as the parameters'
    change instead (:func:`_step_encoded`). ``weights`` are already checked (``check_weights``):
    the rule's arithmetic runs per window without validating each window again."""
    names = sorted(new_params)
    flat_p = [new_params[n].view(-1) for n in names]
    flat_m = [new_momentum[n].view(-1) for n in names]
    rows_in, rule, w_in = voters, chosen, weights
    if not chosen.coordinatewise:
        # Krum and multi-Krum choose rows in a pass over the windows, then merge them by a
        # coordinate-wise rule; the others (centered clipping, geometric median) see all
        # columns at once: one window of width D, a stack of the kept rows.
        picked = chosen.select(deltas, voters, weights)
        if picked is not None:
            rows_in, rule, w_in = picked
    spans = deltas.windows() if rule.coordinatewise else iter([(0, deltas.d)])
    update: dict[str, Encoded] = {}
    g_of: dict[int, torch.Tensor] = {}  # tensor index → its merged g so far (update codec only)
    if update_codec is not None:
        for k, n in enumerate(names):
            if not flat_p[k].numel():  # no window ever covers it
                empty = flat_p[k].new_zeros(0)
                _step_encoded(
                    update_codec,
                    update,
                    n,
                    empty,
                    new_params[n],
                    flat_p[k],
                    flat_m[k],
                    outer,
                    residual,
                )
    for s, e in spans:
        with torch.no_grad():
            merged_n = rule.aggregate(deltas.window(rows_in, s, e), w_in)
        for k, first, last in deltas.spans(s, e):
            at = deltas.starts[k] + first - s
            g = merged_n[at : at + last - first]
            if update_codec is None:
                outer_update_(flat_p[k][first:last], flat_m[k][first:last], g, outer)
                continue
            g_D = g_of.get(k)
            if g_D is None:
                g_D = g_of[k] = torch.empty_like(flat_p[k], dtype=torch.float32)
            g_D[first:last].copy_(g)
            if last == g_D.numel():  # the tensor's last window: encode, then step with ĝ
                del g_of[k]
                n = names[k]
                _step_encoded(
                    update_codec,
                    update,
                    n,
                    g_D,
                    new_params[n],
                    flat_p[k],
                    flat_m[k],
                    outer,
                    residual,
                )
    return update


def _step_encoded(
    codec: Codec,
    update: dict[str, Encoded],
    name: str,
    g_D: torch.Tensor,
    like: torch.Tensor,
    p_D: torch.Tensor,
    m_D: torch.Tensor,
    outer: OuterConfig,
    residual: dict[str, torch.Tensor] | None,
) -> None:
    """Encode one tensor's merged g into ``update[name]`` and step with its decoded value; with
    ``residual``, the named error-feedback step instead: the exact g steps the momentum, and
    the parameters' change is what is encoded and applied (``train.outer.params_step_``)."""
    if residual is not None:
        r_D = residual[name].view(-1)
        update[name] = params_step_(p_D, m_D, r_D, g_D, outer, codec, tuple(like.shape))
        return
    enc = codec.encode(g_D.view(like.shape))
    update[name] = enc
    g_hat = codec.decode(enc).reshape(-1).to(p_D.device)
    outer_update_(p_D, m_D, g_hat, outer)


def _away_from_trusted(deltas: RowSet, accepted: list[int], trusted: list[bool]) -> dict[int, str]:
    """Probationary rows (ADR 0016) among ``accepted`` whose delta points away from the mean of
    the accepted trusted rows (a·m ≤ 0), with their reasons. The mean is summed row by row in
    float64 and a·m comes from squared norms by the fixed tree (‖a‖² + ‖m‖² − ‖a − m‖²), so
    every syncer draws the same line. Window by window; nothing is checked without a trusted
    row or a probationary one."""
    anchors = [j for j in accepted if trusted[j]]
    fresh = [j for j in accepted if not trusted[j]]
    if not anchors or not fresh:
        return {}
    dev = deltas.device
    m2 = SqSums([(0, 0)], deltas.d, dev)
    a2 = SqSums([(t, t) for t in range(len(fresh))], deltas.d, dev)
    d2 = SqSums([(t, t) for t in range(len(fresh))], deltas.d, dev)
    for s, e in deltas.windows():
        anchor_An = deltas.window(anchors, s, e)
        mean_n = anchor_An[0].double()
        for row in anchor_An[1:]:
            mean_n += row.double()
        mean_n /= len(anchors)
        fresh_Fn = deltas.window(fresh, s, e)
        m2.add(mean_n.unsqueeze(0), s)
        a2.add(fresh_Fn, s)
        d2.add(fresh_Fn, s, center_n=mean_n)
    (mm,) = m2.result()
    out = {}
    for j, aa, dd in zip(fresh, a2.result(), d2.result(), strict=True):
        dot = (aa + mm - dd) / 2
        if dot <= 0:
            out[j] = f"points away from the trusted inputs' mean (a·m = {dot:.3g})"
    return out


def _shape_mismatch(
    delta: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], names: list[str]
) -> str:
    for n in names:
        t = delta.get(n)
        if t is None:
            return f"missing tensor {n!r}"
        if tuple(t.shape) != tuple(params[n].shape):
            return f"tensor {n!r} has shape {tuple(t.shape)}, not {tuple(params[n].shape)}"
    return ""
