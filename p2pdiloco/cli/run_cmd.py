"""``p2pdiloco run create``: write, sign and publish a run manifest."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from p2pdiloco.choices import CODECS, RULES, UPDATE_CODECS, check_sparse_rule
from p2pdiloco.cli.common import user_errors
from p2pdiloco.cli.simulate_cmd import parse_agg_params, sync_rules
from p2pdiloco.errors import ConfigError
from p2pdiloco.protocol.identity import Identity, default_identity_path
from p2pdiloco.protocol.records import (
    PROTOCOL_VERSION,
    RunManifest,
    SyncRules,
    WorkScoring,
    default_quorum,
)
from p2pdiloco.train.configs import InnerConfig, OuterConfig
from p2pdiloco.train.schedule import DEFAULT_LEARNERS, plan_run, schedule_of

app = typer.Typer(help="Create and publish training runs.", no_args_is_help=True)
_i, _o, _r = InnerConfig(), OuterConfig(), SyncRules()
# What `run create` signs unless told otherwise: the codec and rule behind the measured figures
# (docs/benchmarks.md: int8 deltas; the coordinate median behind norm screening and clone
# folding keeps every attack of the Byzantine matrix, jittered coalitions included, near the
# clean loss: ADR 0039).
SAFE_COMPRESSION = "int8"
# The certified update's codec (ADR 0029): int8 like the deltas; learners download a quarter of
# what fp32 would take, and the loss measured stayed within noise (docs/benchmarks.md).
SAFE_UPDATE_COMPRESSION = "int8"
SAFE_AGGREGATION = "median"
# Clone folding (ADR 0036): copies of one delta sent under several identities count once; 0.25
# × the honest spread leaves honest deltas apart unless one has ~1/16 of the others' steps.
SAFE_CLONE_FACTOR = 0.25


@app.command("create", short_help="Sign and publish a run manifest.")
@user_errors
def create(
    name: Annotated[str, typer.Option(help="Run name (letters, digits, . _ -).")],
    model: Annotated[str, typer.Option(help="Model name (see `p2pdiloco models`).")],
    data: Annotated[str, typer.Option(help="Data source every learner reads.")] = "embedded",
    seed: Annotated[int, typer.Option(help="Run seed (init, data order).")] = 0,
    inner_steps: Annotated[int, typer.Option(help="Inner steps per round (H).")] = 500,
    time_budget: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Seconds of inner steps per round (mixed hardware): each learner sends after "
            "this long or H steps, whichever comes first [default: H steps only].",
        ),
    ] = None,
    tokens: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Planned tokens, every learner together: sets the inner warm-up and cosine "
            "horizon (ADR 0053) [default: 100 warm-up steps, a 10,000-step horizon].",
        ),
    ] = None,
    rounds: Annotated[
        int | None,
        typer.Option(metavar="N", help="Planned rounds (certified versions), instead of --tokens."),
    ] = None,
    learners: Annotated[
        int, typer.Option(help="Learners a round is planned to merge (turns --tokens into rounds).")
    ] = DEFAULT_LEARNERS,
    inner_lr: Annotated[float, typer.Option(help="Peak AdamW lr.")] = _i.lr,
    batch_size: Annotated[int, typer.Option(help="Sequences per inner step.")] = _i.batch_size,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = _i.seq_len,
    # The same at every planned length: ADR 0060 measured no length below which another wins.
    outer_lr: Annotated[float, typer.Option(help="Outer Nesterov lr.")] = _o.lr,
    outer_momentum: Annotated[float, typer.Option(help="Outer momentum.")] = _o.momentum,
    fragments: Annotated[int, typer.Option(help="Streaming DiLoCo fragments.")] = _o.fragments,
    committee_size: Annotated[int, typer.Option(help="Syncers per round (k).")] = 4,
    quorum: Annotated[
        int | None, typer.Option(help="Signatures to certify [floor(2k/3)+1].")
    ] = None,
    compression: Annotated[
        str, typer.Option(help=f"Delta codec: {', '.join(CODECS)}.")
    ] = SAFE_COMPRESSION,
    update_compression: Annotated[
        str,
        typer.Option(
            help=f"Codec of the certified update learners download: {', '.join(UPDATE_CODECS)}."
        ),
    ] = SAFE_UPDATE_COMPRESSION,
    update_form: Annotated[
        str,
        typer.Option(
            help="What the certified update is: 'gradient' (the merged pseudo-gradient) or "
            "'params' (the parameters' change with the committee's error feedback; any update "
            "codec, topk2 included: ADR 0064)."
        ),
    ] = "gradient",
    update_k: Annotated[
        int | None,
        typer.Option(help="Entries kept per 4096 by a topk2 update codec [default: 64]."),
    ] = None,
    aggregation: Annotated[
        str, typer.Option(help=f"Merge rule: {', '.join(RULES)}.")
    ] = SAFE_AGGREGATION,
    agg_param: Annotated[
        list[str] | None,
        typer.Option(help="Rule parameter KEY=VALUE (repeatable); trimmed_mean defaults to f=1."),
    ] = None,
    clone_factor: Annotated[
        float,
        typer.Option(
            help="Merge screened deltas closer to one another than this × the honest spread as "
            "one (ADR 0036; 0: exact copies only)."
        ),
    ] = SAFE_CLONE_FACTOR,
    clone_folding: Annotated[
        bool, typer.Option(help="Fold copies of one delta into one vote in the merge.")
    ] = True,
    score_work: Annotated[
        bool | None,
        typer.Option(
            "--score-work/--no-score-work",
            help="Count a delta only if it shows work on the learner's own assigned rows "
            "(ADR 0062, 0070: free riders earn nothing; every syncer scores on the corpus, "
            "128 own rows a delta against 128 others, and credits a delta whose own rows "
            "gained 3 standard errors more) [default: on where the test has power: a stretch "
            "of at least 256 rows of at least 128 tokens, one fragment (ADR 0072, 0073)].",
            show_default=False,
        ),
    ] = None,
    screen_norm_factor: Annotated[
        float, typer.Option(help="Screen out deltas above this × the median norm (0: off).")
    ] = _r.screen_norm_factor or 0.0,
    weight_cap: Annotated[
        float, typer.Option(help="Largest share of a round's merge weight one learner may hold.")
    ] = _r.weight_cap,
    staleness: Annotated[
        int, typer.Option(help="Oldest base version a round accepts: current − staleness.")
    ] = _r.staleness,
    grace: Annotated[
        float, typer.Option(help="Seconds a round collects before closing with what it has.")
    ] = _r.grace,
    grace_min: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Adaptive grace: close after 2 × the 90th percentile of recent arrival delays, "
            "at least this and at most --grace [default: off].",
        ),
    ] = None,
    linger: Annotated[
        float, typer.Option(help="Seconds a round keeps collecting once enough learners sent.")
    ] = _r.linger,
    agree_timeout: Annotated[
        float, typer.Option(help="Seconds without a proposal before the next syncer leads.")
    ] = _r.agree_timeout,
    eval_batches: Annotated[
        int,
        typer.Option(
            help="Held-out batches the committee evaluates each certified state on, for the "
            "run's certified loss curve (ADR 0059; 0: none)."
        ),
    ] = 4,
    eval_tolerance: Annotated[
        float,
        typer.Option(help="Relative difference a signer accepts from the leader's eval loss."),
    ] = 1e-3,
    genesis_committee: Annotated[
        list[str] | None,
        typer.Option(
            "--genesis-committee",
            metavar="PEER_ID",
            help="Syncer of the first round (repeatable; default: the creator alone).",
        ),
    ] = None,
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Bootstrap multiaddr (repeatable).")
    ] = None,
    identity: Annotated[Path | None, typer.Option(help="Creator key file.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Sign and print the manifest; publish nothing.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Sign a manifest with this node's key; its hash is the run id; publish it to the DHT.

    Defaults are the safe ones the measurements support (docs/benchmarks.md): int8 deltas and
    the coordinate median behind norm screening and clone folding (ADR 0039). Refuses (exit 2, one line) settings out of
    range and rules this p2pdiloco cannot follow; prints the whole manifest it signed.
    """
    check_sparse_rule(compression, aggregation)
    work, work_note = work_rule(
        score_work, rows=inner_steps * batch_size, seq_len=seq_len, fragments=fragments
    )
    params = parse_agg_params(agg_param or [])
    if aggregation == "trimmed_mean" and not params:
        params = {"f": 1.0}
    rules = sync_rules(
        aggregation=aggregation,
        aggregation_params=params,
        screen_norm_factor=screen_norm_factor or None,
        clone_factor=clone_factor if clone_folding else None,
        weight_cap=weight_cap,
        staleness=staleness,
        grace=grace,
        grace_min=grace_min,
        linger=linger,
        agree_timeout=agree_timeout,
        update_codec=update_compression,
        update_form=update_form,
        update_k=update_k,
        work=work.model_dump() if work is not None else None,
    )
    inner: dict[str, Any] = {"lr": inner_lr, "batch_size": batch_size, "seq_len": seq_len}
    plan = None
    if tokens is not None or rounds is not None:
        plan = plan_run(
            inner_steps=inner_steps,
            batch_size=batch_size,
            seq_len=seq_len,
            rounds=rounds,
            tokens=tokens,
            learners=learners,
        )
        inner["warmup_steps"], inner["total_steps"] = schedule_of(plan, inner_steps)
    check_data(data)
    if (note := personal_path_note(data)) is not None:
        print(f"note: {note}", file=sys.stderr)
    creator = Identity.load_or_create(identity or default_identity_path())
    fields = dict(
        name=name,
        model=model,
        data=data,
        seed=seed,
        inner_steps=inner_steps,
        time_budget=time_budget,
        committee_size=committee_size,
        quorum=quorum if quorum is not None else default_quorum(committee_size),
        inner=inner,
        outer={"lr": outer_lr, "momentum": outer_momentum, "fragments": fragments},
        compression=compression,
        rules=rules.model_dump(),
        genesis_committee=genesis_committee or [],
    )
    if plan is not None:  # a run without a plan signs the very bytes of before (ADR 0053)
        fields["plan"] = plan.model_dump()
    if eval_batches:  # the held-out split of the certified loss curve (ADR 0059)
        fields["held_out"] = {"batches": eval_batches, "seed": seed, "tolerance": eval_tolerance}
    try:
        draft = RunManifest.model_validate(
            {"protocol_version": PROTOCOL_VERSION, "creator": creator.peer_id, "created_at": 0.0}
            | fields
        )
        # Settings checked: now the rules' code (torch) and the network stack (hivemind).
        from p2pdiloco.net.manifests import create_manifest
        from p2pdiloco.sync.rules import check_supported

        check_supported(draft)  # before signing: never publish a run this build cannot follow
        if draft.time_budget is not None and draft.time_budget >= draft.rules.grace:
            raise ConfigError(
                f"--time-budget {draft.time_budget:g} s must be below --grace "
                f"{draft.rules.grace:g} s: every round would close before a learner sends"
            )
        run_id, manifest, raw = create_manifest(creator, **fields)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(
            f"invalid run setting {'.'.join(map(str, err['loc']))}: {err['msg']}"
        ) from None
    if not dry_run:
        from p2pdiloco.cli.net_common import dht_client
        from p2pdiloco.net.manifests import publish_manifest

        with dht_client(bootstrap) as dht:
            publish_manifest(dht, run_id, manifest, raw)
    if work_note is not None:  # stderr, so --json's one object stays alone on stdout
        typer.echo(f"note: {work_note}", err=True)
    signed = manifest.model_dump(mode="json")
    if json_out:
        print(json.dumps({"run_id": run_id, "published": not dry_run, "manifest": signed}))
        return
    print(json.dumps(signed, indent=2, sort_keys=True))
    what = "signed (dry run: not published)" if dry_run else "published"
    print(f"run {manifest.name} ({manifest.model}) {what}\nrun id {run_id}")


# Where ADR 0070 measured the z test's power (the README's settings: 400 rows of 128 tokens a
# stretch, one fragment): `run create` signs it by default there and only there (ADR 0072).
Z_LEAST_SEQ_LEN = 128
Z_ROWS_PER_SCORED = 2


def work_rule(
    asked: bool | None, *, rows: int, seq_len: int, fragments: int
) -> tuple[WorkScoring | None, str | None]:
    """The work scoring ``run create`` signs, and a line for the creator when it is not what a
    run at the defaults gets. ``asked``: ``--score-work`` (True), ``--no-score-work`` (False)
    or neither (None: the z test where it has power, ADR 0072). ``rows``: rows a stretch trains
    (H × batch)."""
    if asked is False:
        return None, None
    z = WorkScoring.z_test()
    scored = z.batches * z.rows
    weak = []
    if rows < Z_ROWS_PER_SCORED * scored:
        weak.append(
            f"a stretch trains {rows} rows, fewer than {Z_ROWS_PER_SCORED} × the {scored} scored"
        )
    if seq_len < Z_LEAST_SEQ_LEN:
        weak.append(f"rows of {seq_len} tokens, fewer than {Z_LEAST_SEQ_LEN}")
    if fragments > 1:
        weak.append(f"{fragments} fragments, where it is not measured")
    if not weak:
        return z, None
    why = "; ".join(weak)
    if asked:
        return z, f"{why}: honest deltas may show their work less often (ADR 0070, 0072)"
    return None, (
        f"this run scores no work ({why}: the test would rarely credit honest work, ADR 0072): "
        "free riders can earn receipts and trust; --score-work signs it anyway"
    )


def personal_path_note(source: str) -> str | None:
    """A line when ``--data`` names a path under this user's home directory: the manifest
    publishes it as typed (every volunteer reads the same path), so the user's name goes with
    it; None for any other source."""
    if source == "embedded" or source.startswith("hf:"):
        return None
    home = Path.home().resolve()
    if not (source.startswith("~") or Path(source).resolve().is_relative_to(home)):
        return None
    return (
        f"--data '{source}' is published in the signed manifest as typed, and volunteers need "
        "the same path: it lies under your home directory, whose name is then public; a path "
        "like /data/NAME or an hf:NAME dataset keeps it private"
    )


def check_data(source: str) -> None:
    """Refuse, before anything is signed, a ``--data`` path no volunteer could train on: a
    missing or unreadable path, a binary file, a directory without text (DataError, one line).
    ``embedded`` needs no check; ``hf:`` names are checked for form only (no download here)."""
    from p2pdiloco.train.sources import DataError, iter_documents

    if source == "embedded":
        return
    if source.startswith("hf:"):
        if not source[len("hf:") :].partition("@")[0].partition(":")[0]:
            raise DataError(f"--data '{source}': expected hf:NAME[:CONFIG][@SPLIT]")
        return
    try:
        next(iter(iter_documents(source, max_bytes=1 << 16)))
    except StopIteration:
        raise DataError(f"--data '{source}' holds no text to train on") from None
