"""The Byzantine matrix: attack × attacker fraction × merge rule, each beside the clean run.

Every cell is one ``p2pdiloco simulate`` run (M learners in one process, real tensors, the
syncer's own screening and merge, the last B learners attacking through
``sync.attacks.Attacker``, omniscient: they see the round's honest deltas and one another's),
all on the same data, seed and schedule. Per cell it prints the final eval loss as a ratio to
the clean run (plain mean, M honest learners, no attacker), the share of honest deltas the
merge accepted and the share of the attackers' deltas it accepted; a cell meets the brief's
target (section 7) when the ratio is ≤ 1.03 and ≥ 99% of honest deltas were accepted. Beside
it, the ratio to the honest-only run: the M − B honest learners alone, on the same shards and
batches as in every cell (plain mean; the attackers send 20× deltas that screening drops from
every merge, which the bench checks). The best a defence can do is drop the attackers, which
also drops their share of the tokens, so a cell whose attackers were all rejected can miss the
first ratio and sit at 1.000 on the second.

    .venv/bin/python bench/byzantine.py                       # the default rule, every cell
    .venv/bin/python bench/byzantine.py --rules all --attacks alie,collude --fractions 3/8
    .venv/bin/python bench/byzantine.py --rules trimmed_mean:f=3,multi_krum:f=3 --json

A rule is NAME or NAME:KEY=VALUE[,KEY=VALUE] (``trimmed_mean:f=3``); bare names take the
parameters in ``RULE_PARAMS``. What ``run create`` and ``demo`` sign is the default here: the
coordinate median (ADR 0039) with ``--clone-factor 0.25``, the manifest's ``clone_factor``
(clone folding, ADR 0036), set in every cell but the two references; ``--clone-factor
none,0.25`` runs every cell under each value.
Writes ``byzantine.json`` (after every cell, so a cut run keeps what it measured),
``byzantine-heatmap.png/.svg`` (loss ratio per attack × fraction, one panel per rule) and
``byzantine-curves.png/.svg`` (eval loss per round, one panel per attack) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.choices import RULES
from p2pdiloco.harness.simulate import run_simulation
from p2pdiloco.protocol.records import SyncRules, WorkScoring
from p2pdiloco.train.configs import InnerConfig, OuterConfig, SimulateConfig

# inflate lies in the signed header, which the simulator does not have: bench/demo_attacks.py.
ATTACKS = ("sign-flip", "scale", "noise", "alie", "ipm", "replay", "mimic", "collude")
DEFAULT_RULE = "median"  # what `run create` and `demo` sign (ADR 0039), with clone folding 0.25
RULE_PARAMS: dict[str, dict[str, Any]] = {
    "mean": {},
    "median": {},
    "trimmed_mean": {"f": 1},
    "krum": {"f": 1},
    "multi_krum": {"f": 1},
    "centered_clip": {"tau": 1.0, "relative": 1.0},  # a manifest holds numbers: 1.0 = True
    "geometric_median": {},
}
LOSS_TARGET = 1.03  # final eval loss ÷ clean run, at most
HONEST_TARGET = 0.99  # share of honest deltas accepted, at least


def parse_rule(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME:K=V,K=V`` → (name, params); bare names take ``RULE_PARAMS``."""
    name, _, rest = spec.partition(":")
    if name not in RULES:
        raise SystemExit(f"unknown rule {name!r}; one of {', '.join(RULES)}")
    if not rest:
        return name, dict(RULE_PARAMS[name])
    params: dict[str, Any] = {}
    for item in rest.split(","):
        key, _, value = item.partition("=")
        flag = {"true": 1.0, "false": 0.0}.get(value.lower())  # a manifest holds numbers only
        params[key] = flag if flag is not None else float(value)
        if isinstance(params[key], float) and params[key].is_integer() and key in ("f", "m"):
            params[key] = int(params[key])
    return name, params


def rule_label(name: str, params: dict[str, Any]) -> str:
    shown = {k: v for k, v in params.items() if k != "relative"}
    return name + (f"({', '.join(f'{k}={v}' for k, v in shown.items())})" if shown else "")


def run_cell(
    a: argparse.Namespace,
    rule: tuple[str, dict[str, Any]],
    attack: str | None,
    attackers: int,
    clone: float | None = None,
    jitter: float = 0.0,
) -> dict[str, Any]:
    name, params = rule
    m = a.learners
    cfg = SimulateConfig(
        learners=m,
        inner_steps=a.inner_steps,
        rounds=a.rounds,
        data=a.data,
        seed=a.seed,
        baseline=False,
        eval_batches=a.eval_batches,
        compression=a.compression,
        rules=SyncRules(
            aggregation=name,
            aggregation_params=params,
            clone_factor=clone,
            work={"paired": WorkScoring(), "z": WorkScoring.z_test(), None: None}[a.work],
        ),
        adversaries=attackers,
        attack=attack or "sign-flip",
        attack_jitter=jitter,
        inner=InnerConfig(lr=a.lr, warmup_steps=2, batch_size=a.batch_size, seq_len=a.seq_len),
        outer=OuterConfig(lr=0.7, momentum=0.5),  # short-run momentum: docs/adr/0006
    )
    t0 = time.perf_counter()
    res = run_simulation(cfg)
    bad = set(res.adversaries)
    merges = a.rounds  # one fragment: one merge per round
    honest = [i for i in range(m) if i not in bad]
    return {
        "rule": rule_label(name, params)
        + ("" if clone is None else f" clones≤{clone:g}")
        + (f" jitter {jitter:g}" if jitter else ""),
        "jitter": jitter,
        "clone_factor": clone,
        "aggregation": name,
        "params": params,
        "attack": attack or "clean",
        "learners": m,
        "attackers": attackers,
        "fraction": f"{Fraction(attackers, a.learners)}" if attackers else "0",
        "loss": res.diloco.eval_loss_final,
        "loss_initial": res.diloco.eval_loss_initial,
        "eval_losses": res.diloco.eval_losses,
        "honest_accepted": sum(res.accepted_deltas[i] for i in honest) / (len(honest) * merges),
        "attacker_accepted": (
            sum(res.accepted_deltas[i] for i in bad) / (len(bad) * merges) if bad else None
        ),
        # merged with credit: with work scoring a trusted delta that shows no advantage on its
        # own data is merged uncredited (ADR 0065); without scoring the same as accepted
        "honest_credited": sum(res.accepted_deltas[i] - res.uncredited_deltas[i] for i in honest)
        / (len(honest) * merges),
        "attacker_credited": (
            sum(res.accepted_deltas[i] - res.uncredited_deltas[i] for i in bad)
            / (len(bad) * merges)
            if bad
            else None
        ),
        "honest_folded": sum(res.folded_deltas[i] for i in honest) / (len(honest) * merges),
        "attacker_folded": (
            sum(res.folded_deltas[i] for i in bad) / (len(bad) * merges) if bad else None
        ),
        "seconds": time.perf_counter() - t0,
    }


def judge(row: dict[str, Any], clean_loss: float, honest_only_loss: float) -> None:
    """Adds both ratios, met/missed and, for a miss, its reason (measured, not guessed)."""
    row["loss_ratio"] = row["loss"] / clean_loss
    row["loss_ratio_honest_only"] = row["loss"] / honest_only_loss
    reasons = []
    if row["loss_ratio"] > LOSS_TARGET:
        took, vs_honest = row["attacker_accepted"], row["loss_ratio_honest_only"]
        if took:
            why = f"{took:.0%} of the attackers' deltas passed screening"
        elif vs_honest <= LOSS_TARGET:
            why = (
                f"every attacker screened out; {vs_honest:.3f} × the honest learners alone: "
                "their missing tokens, not poisoning"
            )
        else:
            why = f"every attacker screened out, yet {vs_honest:.3f} × the honest learners alone"
        reasons.append(f"loss {row['loss_ratio']:.3f} × clean > {LOSS_TARGET} ({why})")
    if row["honest_accepted"] < HONEST_TARGET:
        reasons.append(f"only {row['honest_accepted']:.1%} of honest deltas accepted")
    row["met"] = not reasons
    row["reason"] = "; ".join(reasons)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'rule':24} {'attack':10} {'frac':>4} {'loss':>7} {'÷ clean':>8} {'÷ honest':>8} "
        f"{'honest in':>9} {'credited':>8} {'attack in':>9} {'credited':>8}  target"
    ]
    for r in rows:
        took = "-" if r["attacker_accepted"] is None else f"{r['attacker_accepted']:.0%}"
        paid = "-" if r.get("attacker_credited") is None else f"{r['attacker_credited']:.0%}"
        lines.append(
            f"{r['rule']:24} {r['attack']:10} {r['fraction']:>4} {r['loss']:7.4f} "
            f"{r['loss_ratio']:8.3f} {r['loss_ratio_honest_only']:8.3f} "
            f"{r['honest_accepted']:9.0%} {r.get('honest_credited', r['honest_accepted']):8.0%} "
            f"{took:>9} {paid:>8}  " + ("met" if r["met"] else f"MISSED: {r['reason']}")
        )
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_heatmap(report: dict[str, Any], stem: Path) -> None:
    """Loss ratio per attack (rows) × fraction (columns), one panel per rule; red = missed."""
    plt = _pyplot()
    rows = [r for r in report["rows"] if r["attackers"]]
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    attacks = list(dict.fromkeys(r["attack"] for r in rows))
    fracs = sorted({r["fraction"] for r in rows}, key=Fraction)
    if not rules:
        return
    fig, axes = plt.subplots(
        1,
        len(rules),
        figsize=(max(4.5, 1.2 + 2.3 * len(rules)), 1.2 + 0.38 * len(attacks)),
        squeeze=False,
    )
    cell = {(r["rule"], r["attack"], r["fraction"]): r for r in rows}
    for ax, rule in zip(axes[0], rules, strict=True):
        grid = [
            [cell.get((rule, at, fr), {}).get("loss_ratio", float("nan")) for fr in fracs]
            for at in attacks
        ]
        ax.imshow(grid, cmap="RdYlGn_r", vmin=0.97, vmax=1.15, aspect="auto")
        for i, at in enumerate(attacks):
            for j, fr in enumerate(fracs):
                r = cell.get((rule, at, fr))
                if r is not None:
                    mark = "" if r["met"] else " ✗"
                    ax.text(
                        j,
                        i,
                        f"{r['loss_ratio']:.3f}{mark}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if r["loss_ratio"] > 1.09 else "black",
                    )
        ax.set_xticks(range(len(fracs)), fracs)
        ax.set_yticks(range(len(attacks)), attacks if ax is axes[0][0] else [""] * len(attacks))
        ax.set_title(rule, fontsize=8)
        ax.set_xlabel("attackers", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(
        f"eval loss ÷ clean run; ✗ missed (> {LOSS_TARGET} or < 99% honest in)", fontsize=8
    )
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(f"{stem}.{ext}", dpi=110)
    plt.close(fig)


def plot_curves(report: dict[str, Any], stem: Path) -> None:
    """Eval loss per round for the first rule: one panel per attack, a line per fraction."""
    plt = _pyplot()
    rows = [r for r in report["rows"] if r["attackers"]]
    if not rows:
        return
    rule = rows[0]["rule"]
    attacks = list(dict.fromkeys(r["attack"] for r in rows if r["rule"] == rule))
    cols = min(4, len(attacks))
    nrows = -(-len(attacks) // cols)
    fig, axes = plt.subplots(
        nrows, cols, figsize=(max(4.0, 2.6 * cols), 2.1 * nrows), squeeze=False
    )
    clean = report["clean"]["eval_losses"]
    for k, attack in enumerate(attacks):
        ax = axes[k // cols][k % cols]
        ax.plot(range(1, len(clean) + 1), clean, color="black", lw=1.5, label="clean")
        for r in rows:
            if r["rule"] == rule and r["attack"] == attack:
                ax.plot(
                    range(1, len(r["eval_losses"]) + 1),
                    r["eval_losses"],
                    lw=1,
                    marker=".",
                    label=r["fraction"],
                )
        ax.set_title(attack, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("round", fontsize=7)
        ax.set_xticks(range(1, len(clean) + 1))
        if k == 0:
            ax.legend(fontsize=6)
    for k in range(len(attacks), nrows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle(f"eval loss per round, {rule}", fontsize=9)
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(f"{stem}.{ext}", dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rules", default=DEFAULT_RULE, help="comma list of rule specs, or 'all'")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--fractions", default="1/8,1/4,3/8", help="attackers ÷ learners")
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--compression", default="none")
    ap.add_argument("--clone-factor", default="0.25", help="comma list: none or a number")
    ap.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="each attacker adds noise of this × the honest std (clone evasion)",
    )
    ap.add_argument(
        "--work",
        nargs="?",
        const="paired",
        choices=["paired", "z"],
        help="score work in every cell (rules.work): the paired score (ADR 0065, bare --work) "
        "or the z test `run create` signs (ADR 0070); the learners are trusted members",
    )
    ap.add_argument("--data", default="embedded")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "byzantine")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rule_specs = list(RULE_PARAMS) if a.rules == "all" else a.rules.split(",")
    rules = [parse_rule(s) for s in rule_specs]
    attacks = [x for x in a.attacks.split(",") if x]
    counts = sorted({round(float(Fraction(f)) * a.learners) for f in a.fractions.split(",")})
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": " ".join(["bench/byzantine.py", *sys.argv[1:]]),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "targets": {"loss_ratio_max": LOSS_TARGET, "honest_accepted_min": HONEST_TARGET},
        "rows": [],
    }

    def save() -> None:
        (a.out / "byzantine.json").write_text(json.dumps(report, indent=2) + "\n")

    clean = run_cell(a, ("mean", {}), None, 0)
    judge(clean, clean["loss"], clean["loss"])
    report["clean"] = clean
    print(f"clean (mean): loss {clean['loss']:.4f} in {clean['seconds']:.1f} s", file=sys.stderr)
    # The honest learners alone, on the very shards and batches they have in every cell: the
    # plain mean, with the B attackers' 20× deltas screened out of every merge (checked).
    alone = {0: clean["loss"]}  # attackers → loss of the honest learners alone
    for b in counts:
        only = run_cell(a, ("mean", {}), "scale", b)
        if only["attacker_accepted"] != 0:
            raise SystemExit("screening let a 20× delta through: no honest-only reference")
        alone[b] = only["loss"]
        report.setdefault("honest_only", []).append(only)
        print(f"honest only ({a.learners - b} of 8): loss {only['loss']:.4f}", file=sys.stderr)
    clones = [None if c == "none" else float(c) for c in a.clone_factor.split(",")]
    for rule, clone in [(r, c) for r in rules for c in clones]:
        cells = [(None, 0)] if rule[0] != "mean" or clone is not None else []
        cells += [(attack, b) for b in counts for attack in attacks]
        for attack, b in cells:
            row = run_cell(a, rule, attack, b, clone, a.jitter if attack else 0.0)
            judge(row, clean["loss"], alone[b])
            report["rows"].append(row)
            save()
            print(
                f"{row['rule']} {row['attack']} {row['fraction']}: ratio {row['loss_ratio']:.3f} "
                f"honest {row['honest_accepted']:.0%} ({row['seconds']:.1f} s)",
                file=sys.stderr,
            )
    save()
    plot_heatmap(report, a.out / "byzantine-heatmap")
    plot_curves(report, a.out / "byzantine-curves")
    if a.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(table([clean, *report["rows"]]))
        missed = [r for r in report["rows"] if not r["met"]]
        print(
            f"\n{len(report['rows']) - len(missed)} of {len(report['rows'])} cells met the target"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
