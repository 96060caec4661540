"""Free riders against honest learners: what they earn, where they sit, what the run loses.

One process, real tensors, the network's own pieces: honest learners train gemma-tiny from the
certified parameters on the rows assigned to them (``train.data.assigned_rows``, as ``join``
reads them with work scoring); free riders train nothing and send, each round,

    replay   the last certified update (what the ``update`` op serves), from version 1 on
    copy     a copy of one honest learner's delta of the round (every copier the same one)
    scaled   the mean of the last three certified updates, scaled up 1.5× (scaled history)
    noise    Gaussian noise with the norm of the last certified update

claiming an honest delta's steps and tokens (H, H × batch × seq_len). Each version is merged by
``sync.aggregator.merge_round`` (the run's rule, screening, clone folding, and with ``rules
.work`` the work check of ``sync.scoring``), the input set filled as ``core.round`` fills it
(every trusted submission, probationary ones up to ``probation_room``, weights capped by
``cap_probation``); receipts make the roster (``core.roster.next_roster``), trust and seats
come from it (``core.trust.trusted_of_roster``, ``core.roster.committee_of_roster``). Per
kind it prints the free riders' receipts, tokens, whether any is trusted, their committee seats,
the versions certified and the final eval loss, beside the same run without free riders, with
work scoring on (the paired score of ADR 0065) and off (before ADR 0062).

    .venv/bin/python bench/freeride.py                     # every kind, scoring on and off
    .venv/bin/python bench/freeride.py --kinds replay --scoring on --rounds 4 --json

``--real``: the replay riders against real processes on loopback instead
(``p2pdiloco.harness.freeride``: a bootstrap and three honest ``join`` processes, the tests'
small setting, work scoring on), beside the same run without them: for each (riders, first
version ridden) in ``--cases``, the seconds from the first send until every node holds
version ``--until`` and the versions certified per minute, honest acceptance, and the riders'
receipts, tokens, trust and seats from the verified chain (what ``status --leaderboard``
reads). The clean run (0 riders) fetches the same updates and sends nothing.

    .venv/bin/python bench/freeride.py --real --cases 0@1,4@1,0@3,2@3 --until 10

``--side-by-side N``: the cases run at the same time, each in its own process (so a busy
machine slows them alike), N times over; it prints each case's versions per minute against
the clean case (0 riders) of the same repeat and start, and the ratio pooled over the repeats.

    .venv/bin/python bench/freeride.py --real --cases 0@3,2@3 --until 10 --side-by-side 3

``--real-work z``: the run as ``run create --score-work`` signs it at the README's settings
(H = 50 × 8 rows of 128 tokens, every node training all the time, the z test of ADR 0070,
ADR 0072) instead of the tests' small setting with the paired score.

    .venv/bin/python bench/freeride.py --real --real-work z --cases 0@1,4@1 --until 10 --side-by-side 1
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.core.roster import committee_of_roster, genesis_roster, next_roster
from p2pdiloco.core.trust import cap_probation, probation_room, trusted_of_roster
from p2pdiloco.core.weights import merge_weights
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.certificates import Accepted
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest, WorkScoring
from p2pdiloco.sync.aggregator import MergeError, MergeInput, merge_round
from p2pdiloco.sync.scoring import Reference, WorkCheck, WorkScorer
from p2pdiloco.sync.update import update_codec
from p2pdiloco.train.configs import InnerConfig, OuterConfig
from p2pdiloco.train.data import assigned_rows, build_corpus, eval_batches
from p2pdiloco.train.inner import evaluate, make_inner_optimizer, train_steps
from p2pdiloco.train.learner import data_seed
from p2pdiloco.train.models import build_model, get_spec, param_state
from p2pdiloco.train.tokenizer import load_tokenizer

KINDS = ("replay", "copy", "scaled", "noise")


@dataclass
class Setup:
    honest: int = 3
    riders: int = 2  # free riders of the one kind in a run
    rounds: int = 4
    inner_steps: int = 8
    batch_size: int = 4
    seq_len: int = 32
    committee: int = 3
    seed: int = 0


@dataclass
class Outcome:
    kind: str
    scoring: bool
    versions: int  # certified (a merge that screening emptied certifies nothing)
    eval_loss: float
    rider_receipts: int
    rider_tokens: int
    rider_trusted: int  # free riders trusted after the last version
    rider_seats: int  # committee seats the free riders held over the run
    honest_receipts: int
    honest_refused: int  # honest deltas refused (work scoring must keep this at 0)
    honest_uncredited: int  # honest deltas merged without credit (trusted, no work shown)
    score_seconds: float  # wall time the work check took, all versions
    scored: int  # deltas scored, all versions
    honest_advantage: list[float] = field(default_factory=list)
    rider_advantage: list[float] = field(default_factory=list)


def identity(tag: str) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"bench/freeride/{tag}".encode()).digest())


def manifest(s: Setup, genesis: list[str], scoring: bool) -> RunManifest:
    rules: dict[str, object] = {"aggregation": "median", "clone_factor": 0.25}
    if scoring:
        rules["work"] = WorkScoring().model_dump()
    _, m, _ = create_manifest(
        identity("creator"),
        created_at=0.0,
        name="freeride",
        model="gemma-tiny",
        data="embedded",
        seed=s.seed,
        inner_steps=s.inner_steps,
        committee_size=s.committee,
        inner={"batch_size": s.batch_size, "seq_len": s.seq_len},
        rules=rules,
        genesis_committee=genesis,
    )
    return m


def rider_delta(
    kind: str,
    history: list[dict[str, torch.Tensor]],
    honest: list[dict[str, torch.Tensor]],
    like: Mapping[str, torch.Tensor],
    gen: torch.Generator,
) -> dict[str, torch.Tensor] | None:
    """What a free rider of ``kind`` sends this round (None: nothing to send yet)."""
    if kind == "copy":
        return {n: t.clone() for n, t in honest[0].items()}
    if not history:
        return None
    last = history[-1]
    if kind == "replay":
        return {n: t.clone() for n, t in last.items()}
    if kind == "scaled":
        few = history[-3:]
        return {n: 1.5 * sum(h[n] for h in few) / len(few) for n in like}
    norm = torch.sqrt(sum(t.double().square().sum() for t in last.values()))
    noise = {n: torch.randn(like[n].shape, generator=gen) for n in like}
    scale = norm / torch.sqrt(sum(t.double().square().sum() for t in noise.values()))
    return {n: (t * scale).float() for n, t in noise.items()}


def run(s: Setup, kind: str | None, scoring: bool) -> Outcome:
    torch.manual_seed(s.seed)
    honest_ids = [identity(f"honest{i}").peer_id for i in range(s.honest)]
    rider_ids = [identity(f"{kind}{i}").peer_id for i in range(s.riders)] if kind else []
    m = manifest(s, honest_ids[: s.committee], scoring)
    inner = InnerConfig(
        batch_size=s.batch_size, seq_len=s.seq_len, total_steps=s.rounds * s.inner_steps
    )
    tok = load_tokenizer(get_spec("gemma-tiny").tokenizer)
    corpus = build_corpus("embedded", tok, seq_len=s.seq_len)
    evals = eval_batches(corpus, batch_size=s.batch_size, max_batches=8)
    model = build_model("gemma-tiny", seed=s.seed)
    theta = {n: t.clone() for n, t in param_state(model).items()}
    momentum: dict[str, torch.Tensor] = {}
    outer = OuterConfig(**m.outer.model_dump())
    learners = {}
    for p in honest_ids:
        local = copy.deepcopy(model)
        learners[p] = (local, *make_inner_optimizer(local, inner))
    scorer = (
        WorkScorer(
            copy.deepcopy(model),
            corpus.train_NS,
            m.rules.work,
            m.seed,
            steps=s.inner_steps,
            batch_size=s.batch_size,
        )
        if m.rules.work is not None
        else None
    )
    codec = update_codec(m.rules.update_codec)
    roster = genesis_roster(m)
    history: list[dict[str, torch.Tensor]] = []
    gen = torch.Generator().manual_seed(s.seed)
    tokens = s.inner_steps * s.batch_size * s.seq_len
    out = Outcome(kind or "none", scoring, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0)
    advantages: dict[str, float] = {}
    for v in range(s.rounds):
        trusted = trusted_of_roster(m, roster, v)
        seats = committee_of_roster(m, roster, v, f"{v}".encode()).members
        out.rider_seats += sum(p in rider_ids for p in seats)
        deltas: dict[str, dict[str, torch.Tensor]] = {}
        for p, (local, opt, sched) in learners.items():
            with torch.no_grad():
                for n, t in param_state(local).items():
                    t.copy_(theta[n])
            rows, _ = assigned_rows(
                corpus.num_train_rows,
                seed=data_seed(m.seed, p),
                version=v,
                steps=s.inner_steps,
                batch_size=s.batch_size,
            )
            batches = corpus.train_NS[rows.reshape(s.inner_steps, s.batch_size)]
            train_steps(local, opt, sched, batches, grad_accum=1, grad_clip=inner.grad_clip)
            deltas[p] = {n: theta[n] - t.detach() for n, t in param_state(local).items()}
        honest = [deltas[p] for p in honest_ids]
        for p in rider_ids:
            d = rider_delta(kind or "", history, honest, theta, gen)
            if d is not None:
                deltas[p] = d
        # The input set as core.round makes it: trusted ones, then probationary ones (closest
        # to trust first) up to probation_room; merge weights capped for the probationary.
        is_trusted = {p: trusted is None or p in trusted for p in deltas}
        credit = {e.peer_id: e.accepted for e in roster}
        low = sorted((p for p in deltas if not is_trusted[p]), key=lambda p: -credit.get(p, 0))
        high = [p for p in deltas if is_trusted[p]]
        chosen = sorted(high + low[: probation_room(len(high), m.rules.probation_share)])
        weights = merge_weights({p: (tokens, 0) for p in chosen}, m.rules.weight_cap)
        if trusted is not None:
            weights = cap_probation(
                weights, frozenset(p for p in chosen if not is_trusted[p]), m.rules.probation_share
            )
        inputs = [MergeInput(p, p, deltas[p], weights[p], is_trusted[p]) for p in chosen]
        work = None
        if scorer is not None and m.rules.work is not None:
            score = scorer.bind(theta, v)

            def noted(
                peer: str,
                delta: Mapping[str, torch.Tensor],
                refs: Sequence[Reference] = (),
                score=score,
            ) -> float:
                a = score(peer, delta, refs)
                advantages[peer] = a
                return a

            work = WorkCheck(m.rules.work, noted, history[-1] if history else None, seed=v)
        t0 = time.perf_counter()
        advantages.clear()
        try:
            result = merge_round(
                theta, momentum, inputs, rules=m.rules, outer=outer, update_codec=codec, work=work
            )
        except MergeError as e:
            out.honest_refused += sum(p in e.rejected for p in honest_ids)
            continue
        finally:
            out.score_seconds += time.perf_counter() - t0 if work is not None else 0.0
        for p, a in advantages.items():
            (out.rider_advantage if p in rider_ids else out.honest_advantage).append(round(a, 4))
        out.versions += 1
        history.append({n: codec.decode(e) for n, e in result.update.items()})
        theta, momentum = result.params, result.momentum
        out.honest_refused += sum(p in result.rejected for p in honest_ids)
        out.honest_uncredited += sum(p in result.uncredited for p in honest_ids)
        receipts = [
            Accepted(
                peer_id=p,
                digest=hashlib.sha256(f"{p}/{v}".encode()).hexdigest(),
                steps=s.inner_steps,
                tokens=0 if p in result.uncredited else tokens,  # no work shown: no credit
            )
            for p in result.accepted
        ]
        roster = next_roster(
            roster, new_version=out.versions, accepted=receipts, window=m.rules.roster_window
        )
    with torch.no_grad():
        for n, t in param_state(model).items():
            t.copy_(theta[n])
    out.eval_loss = evaluate(model, evals)
    for e in roster:
        if e.peer_id in rider_ids:
            out.rider_receipts += e.accepted
            out.rider_tokens += e.tokens
        elif e.peer_id in honest_ids:
            out.honest_receipts += e.accepted
    final = trusted_of_roster(m, roster, out.versions)
    out.rider_trusted = sum(final is None or p in final for p in rider_ids if kind)
    out.scored = scorer.scored if scorer is not None else 0
    return out


def real_case(riders: int, start: int, until: int, work: str = "paired") -> dict[str, object]:
    """One real-process run (see the module docstring): ``riders`` replay riders (0: the clean
    run) from certified version ``start`` until every node holds ``until``, timed from their
    first send (with none, from the moment they would have sent). ``work``: ``paired`` (the
    tests' small setting, ADR 0065's score) or ``z`` (the README's run as ``run create
    --score-work`` signs it: H = 50 × 8 rows of 128 tokens, the z test, ADR 0072)."""
    import tempfile

    from p2pdiloco.core.ledger import build_ledger, verified_chain
    from p2pdiloco.core.trust import round_trusted
    from p2pdiloco.harness.demo import LocalNetwork
    from p2pdiloco.harness.demo_config import DemoConfig
    from p2pdiloco.harness.freeride import ride
    from p2pdiloco.protocol.records import SyncRules
    from p2pdiloco.train.configs import InnerConfig, OuterConfig

    signed: dict[str, Any] = {}
    if work == "z":  # the README's run with --score-work; every node trains all the time
        outer, inner = OuterConfig(), InnerConfig()
        sync = SyncRules()
        cfg = DemoConfig(
            inner_steps=50,
            outer_lr=outer.lr,
            outer_momentum=outer.momentum,
            grace=sync.grace,
            agree_timeout=sync.agree_timeout,
        )
        # run create's inner schedule (no plan: the manifest's warmup and horizon), not the
        # demo's, whose cosine ends after 2 × rounds × H steps
        signed["inner"] = {"lr": inner.lr, "batch_size": inner.batch_size, "seq_len": inner.seq_len}
        rules = WorkScoring.z_test()
    else:
        cfg = DemoConfig(
            inner_steps=4,
            grace=8.0,
            agree_timeout=3.0,
            batch_size=2,
            seq_len=32,
            compute_share=0.25,
        )
        rules = WorkScoring()
    d = tempfile.mkdtemp(prefix="freeride-real-")  # kept: its logs are the evidence
    with LocalNetwork(Path(d), cfg) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(3)]
        run_id = net.publish_run(keys, work=rules.model_dump(), **signed)
        nodes = [net.start_node(f"node{i}", k, until_version=10**6) for i, k in enumerate(keys)]
        rep = ride(net, run_id, nodes, count=riders, start=start, until=until, timeout=3600)
        net.close()
        raws = [p.read_bytes() for p in sorted((nodes[0].dir / "state" / "certs").glob("*.json"))]
        certs, _ = verified_chain(run_id, net.manifest, raws)
        board = {e.peer_id: e for e in build_ledger(run_id, net.manifest, raws).entries}
    honest = {k.peer_id for k in keys}
    fresh = set(rep.riders)
    mine = [board[p] for p in honest if p in board]
    theirs = [board[p] for p in fresh if p in board]
    # whose deltas the next round counts as trusted (founders, in a young z-test run)
    trusted = round_trusted(net.manifest, certs[-1]) if certs else None
    return {
        "riders": riders,
        "work": work,
        "workdir": d,
        "first_base": rep.first_base,
        "until": rep.until,
        "seconds": round(rep.seconds, 1),
        "versions_per_min": round(60 * (rep.until - rep.first_base) / rep.seconds, 2),
        "honest_accepted": sum(e.accepted for e in mine),
        "honest_rejected": sum(e.rejected for e in mine),
        "honest_uncredited": sum(e.uncredited for e in mine),
        "honest_reasons": {r: n for e in mine for r, n in e.reasons.items()},
        "rider_sends_pooled": rep.accepted,
        "rider_sends": len(rep.replies),
        "rider_refusals_certified": sum(e.rejected for e in theirs),
        "rider_receipts": sum(e.accepted for e in theirs),
        "rider_tokens": sum(e.tokens for e in theirs),
        "rider_trusted": len(fresh & trusted) if trusted is not None else len(fresh),
        "rider_seats": sum(len(fresh & set(c.body.committee)) for c in certs),
        "certified": len(certs),
    }


def real(cases: list[tuple[int, int]], until: int, out: Path, work: str = "paired") -> int:
    rows = []
    for riders, start in cases:
        t0 = time.perf_counter()
        row = real_case(riders, start, until, work)
        rows.append(row)
        print(json.dumps(row), f"({time.perf_counter() - t0:.0f}s)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "freeride-real.json").write_text(json.dumps(rows, indent=1))
    return 0


def side_by_side(
    cases: list[tuple[int, int]], until: int, repeats: int, out: Path, work: str = "paired"
) -> int:
    """``cases`` run at once, each in its own ``--real`` process, ``repeats`` times; the
    versions per minute of each ridden case against the clean case of the same start."""
    import subprocess
    import tempfile

    rows: list[dict[str, Any]] = []
    for rep in range(repeats):
        with tempfile.TemporaryDirectory(prefix="freeride-sbs-") as d:
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--real",
                        "--cases",
                        f"{r}@{s}",
                        "--until",
                        str(until),
                        "--out",
                        f"{d}/{r}at{s}",
                        "--real-work",
                        work,
                    ],
                    stdout=subprocess.DEVNULL,
                )
                for r, s in cases
            ]
            codes = [p.wait() for p in procs]
            if any(codes):
                raise SystemExit(f"a case failed (exit codes {codes})")
            got = [
                json.loads(Path(f"{d}/{r}at{s}/freeride-real.json").read_text())[0]
                for r, s in cases
            ]
        for g, (_, start) in zip(got, cases, strict=True):
            g["start"], g["repeat"] = start, rep
        clean = {g["start"]: g for g in got if g["riders"] == 0}
        for g in got:  # against the clean run of the same start, else of the earliest one
            base = clean.get(g["start"]) or (clean[min(clean)] if clean else None)
            if base is not None and g["riders"]:
                g["pace_vs_clean"] = round(g["versions_per_min"] / base["versions_per_min"], 3)
            rows.append(g)
            print(json.dumps(g), flush=True)
    for r, s in cases:
        if not r:
            continue
        mine = [g for g in rows if g["riders"] == r and g["start"] == s]
        same = [g for g in rows if g["riders"] == 0 and g["start"] == s]
        base = same or [g for g in rows if g["riders"] == 0]
        if not base:
            continue
        ratio = sum(g["versions_per_min"] for g in mine) / sum(g["versions_per_min"] for g in base)
        print(f"{r} riders from v{s}: pooled pace {ratio:.3f} of the clean run over {repeats}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "freeride-side-by-side.json").write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--scoring", default="on,off", help="on, off or on,off")
    ap.add_argument("--rounds", type=int, default=Setup.rounds)
    ap.add_argument("--honest", type=int, default=Setup.honest)
    ap.add_argument("--riders", type=int, default=Setup.riders)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--real", action="store_true", help="real processes (see the docstring)")
    ap.add_argument("--cases", default="0@1,4@1,0@3,2@3", help="riders@first version, ...")
    ap.add_argument("--until", type=int, default=10, help="version every node reaches (--real)")
    ap.add_argument("--side-by-side", type=int, default=0, help="--real: cases at once, N times")
    ap.add_argument("--real-work", choices=["paired", "z"], default="paired", help="--real: score")
    args = ap.parse_args(argv)
    if args.real:
        cases = [(int(a), int(b)) for a, b in (c.split("@") for c in args.cases.split(","))]
        if args.side_by_side:
            return side_by_side(cases, args.until, args.side_by_side, args.out, args.real_work)
        return real(cases, args.until, args.out, args.real_work)
    torch.set_num_threads(1)
    s = Setup(rounds=args.rounds, honest=args.honest, riders=args.riders)
    rows: list[Outcome] = []
    for scoring in [x == "on" for x in args.scoring.split(",")]:
        for kind in [None, *args.kinds.split(",")]:
            t0 = time.perf_counter()
            o = run(s, kind, scoring)
            rows.append(o)
            print(
                f"{o.kind:7s} scoring={'on ' if scoring else 'off'} versions={o.versions} "
                f"loss={o.eval_loss:.4f} rider receipts={o.rider_receipts} "
                f"tokens={o.rider_tokens} trusted={o.rider_trusted} seats={o.rider_seats} "
                f"honest receipts={o.honest_receipts} refused={o.honest_refused} "
                f"uncredited={o.honest_uncredited} "
                f"scored={o.scored} in {o.score_seconds:.1f}s ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "freeride.json").write_text(
        json.dumps({"setup": asdict(s), "runs": [asdict(o) for o in rows]}, indent=1)
    )
    if args.json:
        json.dump([asdict(o) for o in rows], sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
