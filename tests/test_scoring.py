"""Work scoring (sync.scoring, ADR 0062): copies and deltas without work earn no receipt."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pdiloco.aggregate.rows import RowSet
from p2pdiloco.protocol.records import RunManifest, SyncRules, WorkScoring, run_id_of
from p2pdiloco.protocol.signing import open_envelope
from p2pdiloco.sync.aggregator import MergeError, MergeInput, merge_round
from p2pdiloco.sync.scoring import WorkCheck, copies, references, scoring_order
from p2pdiloco.train.data import assigned_rows, sample_rows
from p2pdiloco.train.outer import OuterConfig

OLD_MANIFEST = Path(__file__).parent / "data" / "manifest-protocol10.json"
OLD_RUN_ID = "6ec0dd12f6593418f7611c063df87a0c5ef8f706b4bf1a2110f6f02355c3bad2"
D = 64


def vec(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": scale * torch.randn(D, generator=g)}


def params() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(D)}


SEEN: list[str] = []  # the peers the last check() scored, in order


def check(
    scores: Mapping[str, float],
    last: Mapping[str, torch.Tensor] | None = None,
    earned: bool = False,
    **rules: object,
) -> WorkCheck:
    """A work check whose scorer reads each peer's advantage from ``scores`` (``earned``:
    trust in the round is earned, not open to everyone)."""
    SEEN.clear()

    def score(
        peer: str,
        delta: Mapping[str, torch.Tensor],
        refs: object = (),
        rows: object = None,
        digest: object = "",
    ) -> float:
        SEEN.append(peer)
        return scores[peer]

    rules_ = WorkScoring(**rules)  # type: ignore[arg-type]
    return WorkCheck(rules_, score, last, seed=1, trust_earned=earned)


def merge(inputs: list[MergeInput], work: WorkCheck | None, **rules: object):
    return merge_round(
        params(),
        {},
        inputs,
        rules=SyncRules(aggregation="mean", **rules),  # type: ignore[arg-type]
        outer=OuterConfig(),
        work=work,
    )


def inp(peer: str, delta: dict[str, torch.Tensor], trusted: bool = True) -> MergeInput:
    return MergeInput(peer, peer, delta, 1.0, trusted)


def test_an_old_manifest_keeps_its_bytes_and_scores_no_work() -> None:
    env = open_envelope(OLD_MANIFEST.read_bytes(), kind="manifest")
    m = RunManifest.model_validate(env.body)
    assert m.rules.work is None
    assert m.model_dump(mode="json") == env.body  # no "work": null added to its bytes
    assert run_id_of(m) == OLD_RUN_ID
    body = json.loads(OLD_MANIFEST.read_bytes())["body"]
    scored = RunManifest.model_validate({**body, "rules": {**body["rules"], "work": {}}})
    assert scored.rules.work == WorkScoring()
    assert run_id_of(scored) != OLD_RUN_ID  # turning scoring on is another run


def test_assigned_rows_are_a_pure_function_and_split_the_corpus() -> None:
    own, other = assigned_rows(1000, seed=7, version=3, steps=5, batch_size=4)
    again, _ = assigned_rows(1000, seed=7, version=3, steps=5, batch_size=4)
    assert torch.equal(own, again) and own.numel() == 20
    assert sorted(torch.cat([own, other]).tolist()) == list(range(1000))
    nxt, _ = assigned_rows(1000, seed=7, version=4, steps=5, batch_size=4)
    assert not set(own.tolist()) & set(nxt.tolist())  # the next version reads the next rows
    assert torch.equal(sample_rows(other, 8, "x", 1), sample_rows(other, 8, "x", 1))


def test_copies_finds_replays_and_groups() -> None:
    a, b, last = vec(1), vec(2), vec(3)
    rows = RowSet([[a["w"]], [b["w"]], [1.01 * a["w"]], [last["w"] * 2]])
    replays, groups = copies(rows, [0, 1, 2, 3], [last["w"]], 0.95)
    assert replays == {3: "replays the last certified update"}
    assert groups == {0: 0, 2: 0}
    assert copies(rows, [0, 1, 2, 3], None, 0.95)[0] == {}


def test_scoring_order_copies_then_probationary_then_trusted() -> None:
    order = scoring_order(["a", "b", "c", "d"], [True, False, True, False], 5, first={2})
    assert order[0] == 2 and set(order[1:3]) == {1, 3} and order[3] == 0


def test_no_advantage_and_a_replay_earn_no_receipt() -> None:
    """A probationary delta without advantage is refused; a trusted one is merged without credit
    (ADR 0065: its work belongs in the model even when the noise of a few rows hides it), and
    a replay is refused unscored."""
    last = vec(9)
    along = {"w": vec(1)["w"] + vec(2)["w"] + vec(5)["w"]}  # not away from the trusted mean
    inputs = [
        inp("honest", vec(1)),
        inp("lazy", vec(2)),  # trusted, scored, no advantage
        inp("new", vec(4), trusted=False),
        inp("new-lazy", along, trusted=False),  # probationary, scored, no advantage
        inp("replay", {"w": 0.5 * last["w"]}, trusted=False),
    ]
    scores = {"honest": 0.2, "lazy": -0.01, "new": 0.3, "new-lazy": 0.0}
    result = merge(inputs, check(scores, last))
    assert result.accepted == ["honest", "lazy", "new"]
    assert result.uncredited == ["lazy"] and "lazy" not in result.rejected
    assert "no advantage" in result.rejected["new-lazy"]
    assert "replays" in result.rejected["replay"]
    assert sorted(SEEN) == ["honest", "lazy", "new", "new-lazy"]  # the replay costs no scoring


def test_a_replay_the_norm_screen_refused_is_named_a_replay() -> None:
    """A replay of the last update far larger than the honest deltas is refused by the norm
    screen first; the certificate still names what it is (tests/test_freeride_network.py saw
    "norm … > 3.0 × median" for a rider's replay under load)."""
    last = vec(9)
    inputs = [inp(p, vec(k)) for k, p in enumerate(["a", "b", "c"], start=1)]
    inputs.append(inp("replay", {"w": 10 * last["w"]}, trusted=False))
    result = merge(inputs, check(dict.fromkeys("abc", 0.1), last))
    assert result.rejected == {"replay": "replays the last certified update"}
    plain = merge(inputs, None)  # without work scoring: the norm screen's reason, as before
    assert "norm" in plain.rejected["replay"]


def test_past_max_scored_probationary_deltas_are_refused_trusted_ones_merged() -> None:
    along = [{"w": vec(1)["w"] + vec(2)["w"] + vec(k)["w"]} for k in (3, 4)]  # not away
    inputs = [inp("t1", vec(1)), inp("t2", vec(2)), inp("p1", along[0], False)]
    inputs.append(inp("p2", along[1], False))
    scores = dict.fromkeys(["t1", "t2", "p1", "p2"], 0.1)
    result = merge(inputs, check(scores, max_scored=1))
    assert len(SEEN) == 1 and SEEN[0] in ("p1", "p2")  # probationary ones first
    other = "p2" if SEEN[0] == "p1" else "p1"
    assert set(result.accepted) == {"t1", "t2", SEEN[0]}
    assert "not scored" in result.rejected[other]


def test_of_a_group_of_copies_only_the_best_scored_counts_whatever_the_order() -> None:
    honest = vec(1)
    for names in (["a-copier", "b-honest"], ["b-copier", "a-honest"]):
        copier, original = names if "copier" in names[0] else names[::-1]
        inputs = sorted(
            [inp(copier, {"w": honest["w"].clone()}), inp(original, honest), inp("x", vec(5))],
            key=lambda i: i.digest,
        )
        result = merge(inputs, check({copier: 0.0, original: 0.1, "x": 0.1}))
        assert set(result.accepted) == {original, "x"}
        assert set(result.rejected) == {copier}


def test_copies_folded_by_clone_factor_earn_no_receipt_with_scoring() -> None:
    base = vec(1)
    near = {"w": base["w"] + 0.1 * vec(2)["w"]}  # within the fold, below max_cosine
    inputs = [inp("a", base), inp("b", near), inp("c", vec(3)), inp("d", vec(4))]
    scores = {"a": 0.1, "b": 0.1, "c": 0.1, "d": 0.1}
    off = merge(inputs, None, clone_factor=0.5)
    assert "b" in off.accepted and off.folded == {"b": "a"}  # before: a receipt for the copy
    on = merge(inputs, check(scores, max_cosine=0.999), clone_factor=0.5)
    assert "b" not in on.accepted and on.rejected["b"].startswith("folded into")
    assert torch.equal(on.params["w"], off.params["w"])  # merged as before: one row


def test_a_round_of_free_riders_only_certifies_nothing() -> None:
    """While trust is open to everyone (a young run before its first receipt), a round in
    which nothing shows work certifies nothing."""
    inputs = [inp("r1", vec(1)), inp("r2", vec(2))]
    with pytest.raises(MergeError) as e:
        merge(inputs, check({"r1": 0.0, "r2": -0.1}))
    assert set(e.value.rejected) == {"r1", "r2"}


def test_a_lone_trusted_delta_without_shown_work_is_merged_uncredited_once_trust_is_earned() -> (
    None
):
    """ADR 0066: with trust earned (the genesis committee and identities with scored work), a
    round whose only trusted delta shows no work still certifies it, without credit; a
    probationary rider beside it is refused. Before, such a round failed on every attempt and
    the run stalled (stop 49's README walk)."""
    along = {"w": vec(1)["w"] + vec(7)["w"]}  # not away from the trusted row
    inputs = [inp("creator", vec(1)), inp("rider", along, trusted=False)]
    result = merge(inputs, check({"creator": -0.01, "rider": 0.0}, earned=True))
    assert result.accepted == ["creator"] and result.uncredited == ["creator"]
    assert "no advantage" in result.rejected["rider"]
    with pytest.raises(MergeError):  # a probationary delta alone is never merged unshown
        merge([inputs[1]], check({"rider": 0.0}, earned=True))


def test_run_create_scores_work_by_default_where_the_test_has_power(tmp_path: Path) -> None:
    """ADR 0072, 0073: a run made with `run create`'s defaults (H 500 × batch 8 rows of 128
    tokens) signs the z test (ADR 0070); so does the README's --inner-steps 50 (400 rows). Where the
    test would rarely credit honest work (a stretch under 256 rows, rows under 128 tokens,
    fragments) it signs none and says why on stderr; --score-work signs it anyway and
    --no-score-work never, each run signing the rules of before byte for byte."""
    from tests.test_run_plan import create, create_result

    _, default = create(tmp_path)
    assert default.rules.work == WorkScoring.z_test()
    _, readme = create(tmp_path, "--inner-steps", "50")
    assert readme.rules.work == WorkScoring.z_test()
    _, off = create(tmp_path, "--no-score-work")
    assert off.rules.work is None and "work" not in off.model_dump(mode="json")["rules"]
    for weak, why in [
        (["--inner-steps", "31"], "a stretch trains 248 rows, fewer than 2 × the 128 scored"),
        (["--seq-len", "64"], "rows of 64 tokens, fewer than 128"),
        (["--fragments", "2", "--inner-steps", "50"], "2 fragments, where it is not measured"),
    ]:
        out = create_result(tmp_path, *weak)
        assert out.exit_code == 0, out.stderr
        assert json.loads(out.stdout)["manifest"]["rules"].get("work") is None
        note = [line for line in out.stderr.splitlines() if line.startswith("note: ")]
        assert len(note) == 1 and why in note[0] and "scores no work" in note[0], out.stderr
        out = create_result(tmp_path, *weak, "--score-work")
        signed = json.loads(out.stdout)["manifest"]["rules"]["work"]
        assert WorkScoring.model_validate(signed) == WorkScoring.z_test()
        assert why in out.stderr and "less often" in out.stderr, out.stderr


def test_references_are_other_trusted_inputs_in_a_seeded_order() -> None:
    peers = ["a", "b", "c", "d", "e"]
    trusted = [True, True, False, True, True]
    refs = references(peers, trusted, 0, seed=3)
    assert len(refs) == 2 and 0 not in refs and 2 not in refs
    assert refs == references(peers, trusted, 0, seed=3)  # every syncer picks the same
    assert references(peers, [True, False, False, False, False], 0, seed=3) == []


def three_learners(steps: int, batch: int, rows: int) -> tuple[Any, ...]:
    """gemma-tiny and a random-token corpus of ``rows`` rows; learners a, b, c train ``steps``
    steps of ``batch`` rows each on their own consecutive rows from the same base. Returns
    the model (at the base), the corpus, their ``rows_of``, the base, their deltas and a
    generator for noise."""
    from p2pdiloco.train.inner import InnerConfig, make_inner_optimizer, train_steps
    from p2pdiloco.train.models import build_model, param_state
    from p2pdiloco.train.outer import pseudo_gradient

    model = build_model("gemma-tiny", seed=0)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(0)
    corpus_NS = torch.randint(0, vocab, (rows, 33), generator=g)
    n = steps * batch
    own = {p: torch.arange(n * i, n * i + n) for i, p in enumerate("abc")}

    def rows_of(peer: str, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        return own[peer], torch.arange(3 * n, rows)

    base = {k: t.detach().clone() for k, t in param_state(model).items()}
    deltas = {}
    for p in "abc":
        local = copy.deepcopy(model)
        opt, sched = make_inner_optimizer(local, InnerConfig(lr=3e-3, warmup_steps=1))
        train_steps(local, opt, sched, corpus_NS[own[p]].view(steps, batch, 33))
        deltas[p] = pseudo_gradient(base, param_state(local), list(base))
    return model, corpus_NS, rows_of, base, deltas, g


def test_own_training_scores_above_its_peers_on_its_rows_and_noise_below(
    one_torch_thread: None,
) -> None:
    """The real scorer on gemma-tiny (ADR 0065): three learners train 5 steps of 4 rows each on
    their own rows of a random-token corpus; each one's delta, compared on its own rows with the
    two others', shows an advantage; a copy of a peer's delta and noise of the same norm show
    none."""
    from p2pdiloco.sync.scoring import WorkScorer

    model, corpus_NS, rows_of, base, deltas, g = three_learners(steps=5, batch=4, rows=200)
    scorer = WorkScorer(model, corpus_NS, WorkScoring(), run_seed=0, rows_of=rows_of)
    score = scorer.bind(base, 0)
    for p, (q, r) in {"a": "bc", "b": "ac", "c": "ab"}.items():
        assert score(p, deltas[p], [(deltas[q], 1.0), (deltas[r], 1.0)]) > 0, p
    assert score("a", deltas["b"], [(deltas["c"], 1.0)]) <= 0  # b's work on a's rows: none
    # A learner that trained a quarter of the steps is compared with its references scaled to
    # its own norm, not with their larger steps.
    small = {n: 0.25 * t for n, t in deltas["a"].items()}
    assert score("a", small, [(deltas["b"], 0.25), (deltas["c"], 0.25)]) > 0
    norm = math.sqrt(sum(float((t**2).sum()) for t in deltas["a"].values()))
    noise = {n: torch.randn(t.shape, generator=g) for n, t in deltas["a"].items()}
    scale = norm / math.sqrt(sum(float((t**2).sum()) for t in noise.values()))
    assert score("a", {n: t * scale for n, t in noise.items()}, [(deltas["b"], 1.0)]) <= 0
    assert scorer.scored == 6


def test_gap_z_is_calibrated_for_work_not_done_and_grows_with_work_done() -> None:
    """The z test's statistic (ADR 0070): drops on own rows drawn like those on other rows
    give about N(0, 1) (a rider's false credit rate is the threshold's tail, whatever the
    drops' scale); a gap of one spread over 128 rows is far past 3; a side of one row shows
    nothing."""
    from p2pdiloco.sync.scoring import gap_z

    g = torch.Generator().manual_seed(0)
    nulls = torch.tensor(
        [
            gap_z(scale * torch.randn(128, generator=g), scale * torch.randn(128, generator=g))
            for scale in (1e-3, 1.0, 50.0)
            for _ in range(400)
        ]
    )
    assert abs(float(nulls.mean())) < 0.15 and 0.85 < float(nulls.std()) < 1.15
    assert float((nulls > 3.0).float().mean()) < 0.01
    shown = gap_z(torch.randn(128, generator=g) + 1.0, torch.randn(128, generator=g))
    assert shown > 6
    assert gap_z(torch.ones(1), torch.randn(128, generator=g)) == -math.inf
    assert gap_z(torch.zeros(8), torch.zeros(8)) == 0.0  # a zero delta: no gap, no credit


def test_the_z_test_passes_at_z_min_and_scores_without_references() -> None:
    """With ``z_min`` the merge compares a score with it, not with ``margin``, and asks the
    scorer for no reference deltas (ADR 0070)."""
    seen_refs: list[int] = []

    def score(peer: str, delta: object, refs: list[object], rows: object, digest: str) -> float:
        seen_refs.append(len(refs))
        assert digest == peer  # the submission's digest seeds the rows scored
        return {"a": 3.5, "b": 2.9, "c": 3.2}[peer]

    work = WorkCheck(WorkScoring(z_min=3.0), score, None, seed=1, trust_earned=True)
    toward = {"w": vec(1)["w"] + vec(2)["w"]}  # a newcomer along the trusted rows' mean
    inputs = [inp("a", vec(1)), inp("b", vec(2)), inp("c", toward, trusted=False)]
    result = merge(inputs, work)
    assert sorted(result.accepted) == ["a", "b", "c"] and result.uncredited == ["b"]
    assert seen_refs == [0, 0, 0]
    refused = merge(inputs, WorkCheck(WorkScoring(z_min=3.3), score, None, 1, True))
    assert "no advantage" in refused.rejected["c"] and refused.uncredited == ["b"]


def test_a_z_test_manifest_names_its_threshold_and_a_paired_one_keeps_its_bytes() -> None:
    assert "z_min" not in WorkScoring().model_dump(mode="json")
    rules = WorkScoring(z_min=3.0, rows=16)
    assert rules.model_dump(mode="json")["z_min"] == 3.0
    assert WorkScoring.model_validate(rules.model_dump(mode="json")) == rules
    assert rules.pass_mark == 3.0 and WorkScoring(margin=0.01).pass_mark == 0.01


def test_the_z_test_credits_own_training_fresh_or_stale_and_no_copy_or_noise(
    one_torch_thread: None,
) -> None:
    """The real z test on gemma-tiny (ADR 0070): three learners train 8 steps of 8 rows each
    on their own rows of a random-token corpus. Each one's delta passes z_min = 3 on its own
    rows, also scored at a base another's delta has moved (a stale delta); its copy sent as
    another's, and noise of its norm, do not."""
    from p2pdiloco.sync.scoring import WorkScorer

    model, corpus_NS, rows_of, base, deltas, g = three_learners(steps=8, batch=8, rows=400)
    rules = WorkScoring(z_min=3.0, batches=4, rows=16)
    scorer = WorkScorer(model, corpus_NS, rules, run_seed=0, rows_of=rows_of)
    score = scorer.bind(base, 0)
    for p in "abc":
        assert score(p, deltas[p]) > 3.0, p
    moved = {n: base[n] - deltas["b"][n] for n in base}  # the run moved on by b's work
    assert scorer.bind(moved, 1)("a", deltas["a"]) > 3.0  # a's delta, now stale
    assert score("a", deltas["b"]) < 3.0  # b's work sent as a's
    norm = math.sqrt(sum(float((t**2).sum()) for t in deltas["a"].values()))
    noise = {n: torch.randn(t.shape, generator=g) for n, t in deltas["a"].items()}
    scale = norm / math.sqrt(sum(float((t**2).sum()) for t in noise.values()))
    assert score("a", {n: t * scale for n, t in noise.items()}) < 3.0
    assert scorer.scored == 6


def test_a_stopping_node_abandons_a_score_at_its_next_batch(one_torch_thread: None) -> None:
    """A clean stop does not wait out a merge's scores (stop 54's walk: 10-21 s a stop on a
    CPU README run; minutes on a large model): once ``stop`` is called a score under way
    raises MergeStopped before its next batch, the model is left in train mode, and every
    later score raises too (the z test and the paired score)."""
    from p2pdiloco.sync.scoring import WorkScorer
    from p2pdiloco.sync.stopping import MergeStopped
    from tests.mid_loop import stop_at_batch

    model, corpus_NS, rows_of, base, deltas, _ = three_learners(steps=2, batch=8, rows=400)
    for rules in (WorkScoring(z_min=3.0, batches=4, rows=16), WorkScoring()):
        scorer = WorkScorer(model, corpus_NS, rules, run_seed=0, rows_of=rows_of)
        score = scorer.bind(base, 0)
        # mid-score: the node is told to stop
        with stop_at_batch(model, scorer.stop) as batches, pytest.raises(MergeStopped):
            score("a", deltas["a"])
        assert len(batches) == 2 and model.training  # no batch after the stop
        with pytest.raises(MergeStopped):
            score("b", deltas["b"])
        assert scorer.scored == 0


def test_the_z_tests_rows_follow_the_submission_so_a_sender_cannot_train_just_those() -> None:
    """Under the z test the rows scored are drawn with the submission's digest in the seed
    (ADR 0070): the same for every syncer, unknown to the sender until it has committed to a
    delta; the paired score keeps the rows of before (the same run scores the same)."""
    from p2pdiloco.sync.scoring import WorkScorer

    corpus_NS = torch.arange(400 * 5).view(400, 5)

    def rows_of(peer: str, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(0, 200), torch.arange(200, 400)

    def own_rows(scorer: WorkScorer, digest: str = "") -> list[int]:
        own, _ = scorer.batches("p", 3, digest)
        return torch.cat(own)[:, 0].tolist()

    z = WorkScorer(torch.nn.Linear(1, 1), corpus_NS, WorkScoring.z_test(), 0, rows_of)
    assert own_rows(z, "d1") == own_rows(z, "d1") and own_rows(z, "d1") != own_rows(z, "d2")
    assert len(own_rows(z, "d1")) == 128
    paired = WorkScorer(torch.nn.Linear(1, 1), corpus_NS, WorkScoring(), 0, rows_of)
    assert own_rows(paired) == own_rows(paired)


def test_under_the_z_test_a_young_runs_founders_are_merged_uncredited_and_no_one_else() -> None:
    """A run's first stretches cannot show work under the z test (ADR 0070: from random
    initialisation the generic drop swamps the memorised one). While trust is open and nothing
    shows work, the founders' deltas are merged without credit, so the run starts, and a
    newcomer's are refused; under the paired score such a round still certifies nothing."""
    founders = frozenset({"creator"})
    scores = {"creator": -1.2, "newcomer": 0.4}
    inputs = [inp("creator", vec(1)), inp("newcomer", vec(2))]

    def work(**rules: object) -> WorkCheck:
        score = check(scores, **rules).score
        return WorkCheck(WorkScoring(**rules), score, None, 0, False, founders)  # type: ignore[arg-type]

    result = merge(inputs, work(z_min=3.0))
    assert result.accepted == ["creator"] and result.uncredited == ["creator"]
    # ... saying why, for the newcomer's dashboard ("rejected" alone read as its fault)
    assert result.rejected["newcomer"] == "no advantage on its own data (young run: founders only)"
    with pytest.raises(MergeError):  # without a founder the round certifies nothing
        merge(inputs[1:], work(z_min=3.0))
    with pytest.raises(MergeError):  # the paired score keeps ADR 0065's rule
        merge(inputs, work(margin=0.5))
    shown = merge(
        inputs, WorkCheck(WorkScoring(z_min=0.3), check(scores).score, None, 0, False, founders)
    )
    # Once one shows work the others are judged as before: trusted (all, in the open phase)
    # and unshown, merged uncredited.
    assert shown.accepted == ["creator", "newcomer"] and shown.uncredited == ["creator"]


def test_a_group_of_copies_none_of_which_shows_work_is_merged_uncredited() -> None:
    """ADR 0074: refusing a whole group of copies that shows no work let a copier refuse an
    honest delta wherever the test is weak (the Byzantine matrix's mimic cell under the z test
    at its small settings: 86 % of honest deltas merged), and in a young z-test run refuse the
    founder's only delta, so the round certified nothing. Now the group's trusted rows are
    merged uncredited (clone folding makes them one row); a probationary copy is refused; a
    group in which one shows work still counts that one alone."""
    honest = vec(1)
    inputs = [
        inp("a-copier", {"w": honest["w"].clone()}),
        inp("b-honest", honest),
        inp("x", vec(5)),
    ]
    none = {"a-copier": 0.0, "b-honest": 0.0, "x": 0.1}
    folded = merge(inputs, check(none, earned=True), clone_factor=0.5)
    group = {"a-copier", "b-honest"}
    kept = group & set(folded.accepted)
    assert len(kept) == 1 and set(folded.uncredited) == kept and "x" in folded.accepted
    (other,) = group - kept
    assert folded.rejected == {other: f"folded into {kept.pop()}"}  # one row, no receipt
    unfolded = merge(inputs, check(none, earned=True))
    assert set(unfolded.accepted) == {*group, "x"} and set(unfolded.uncredited) == group
    shown = merge(inputs, check({**none, "b-honest": 0.1}, earned=True))
    assert set(shown.accepted) == {"b-honest", "x"} and not shown.uncredited
    assert shown.rejected == {"a-copier": "copies input b-honest"}

    # A young z-test run: a newcomer copies the founder's delta; the founder's is still merged.
    founders = frozenset({"creator"})
    young = [inp("creator", honest), inp("rider", {"w": honest["w"].clone()}, trusted=False)]
    score = check({"creator": -0.5, "rider": 0.2}).score
    result = merge(young, WorkCheck(WorkScoring(z_min=3.0), score, None, 0, False, founders))
    assert result.accepted == ["creator"] and result.uncredited == ["creator"]
    assert result.rejected == {"rider": "no advantage on its own data (young run: founders only)"}
