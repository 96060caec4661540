"""The pure parts of ``bench/chaos.py``: the kill schedule, the log timeline, the verdicts.

Nothing here starts a process or sleeps; ``tests/test_chaos_verify.py`` runs all of it on
hand-made chains and state directories. The definitions the bench reports:

- **stall past grace**: a gap between two consecutive certified versions (certification time =
  the earliest ``version N certified by`` or ``applied version N`` line in any node's log) longer
  than the pacemaker allows one departure (``stall_allowance``): view 0 of v+1 opens when v is
  certified, and its round (training, ``grace``, a silent leader's ``agree_timeout``) ends
  within its ``view_timeout``; a view whose committee cannot reach its quorum is handed to the
  next after its timeout, and that view, which no longer seats the silent member, certifies
  within its own, backed-off timeout (twice view 0's, at most ``view_timeout_max``:
  ``core.views.view_start(rules, 2)``). The schedule keeps at most one node (plus the
  bootstrap) down at a time, fewer than any committee tolerates, so a live committee must have
  certified within that allowance. The gap from the last certificate to the end of the chaos
  is counted too (a stall that never ended is still a stall).
- **lost version**: a version some node logged as certified or applied during the run, for which
  at the end (a) no node holds a certificate verified in an unbroken chain from genesis, or (b)
  two nodes hold certificates of different content (a fork), or (c) a node that had applied it
  (its status file said so) ends with a verified chain shorter than it.
- **corrupt state**: in a node's state directory, a certificate that does not verify as the
  successor of the one before it (signatures, quorum, elected committee, roster), a hole in the
  chain, a checkpoint that fails its own hash, whose tensors do not hash to its certificate's
  ``state_hash`` or whose certificate differs from ``certs/<v>.json``, a ``LATEST`` that names no
  valid checkpoint, or a state that ``ChainStore.restore`` (what a restarted node runs) rejects.
- **goodput**: tokens credited by the certificates certified during the chaos (the receipts'
  ``tokens``, summed) ÷ tokens the nodes could have trained in the same wall time: Σ over nodes
  of its inner-step speed while up (tokens trained ÷ seconds in inner steps, over all its
  lives, from its status file) × the chaos duration.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from p2pdiloco.core.views import view_start
from p2pdiloco.protocol.certificates import Certificate, content_digest, parse_certificate
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.protocol.signing import InvalidRecord
from p2pdiloco.runtime.chain import ChainStore
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.sync.fetch import verify_next
from p2pdiloco.train.checkpoint import CheckpointError, CheckpointStore, load_checkpoint

BOOTSTRAP = "bootstrap"


@dataclass(frozen=True)
class Event:
    t: float  # seconds after the chaos began
    target: str  # a node's name, or "bootstrap"
    action: str  # "kill" (SIGKILL of its process group) or "restart" (same key and state dir)


def make_schedule(
    seed: int,
    seconds: float,
    nodes: Sequence[str],
    every: tuple[float, float] = (20.0, 40.0),
    down: tuple[float, float] = (5.0, 15.0),
    bootstrap: bool = True,
) -> list[Event]:
    """Kills of a random node every ``every`` seconds (uniform), each restarted ``down`` seconds
    later, plus the bootstrap killed once in the middle half of the run and restarted likewise.

    Only a node that is up is killed, and every restart falls before ``seconds``, so the run
    ends with every process up. A pure function of its arguments (a simulator replays it)."""
    rng = random.Random(seed)
    events: list[Event] = []
    up_at = dict.fromkeys(nodes, 0.0)  # when each node is back up
    t = rng.uniform(*every)
    while t + down[1] < seconds:
        candidates = [n for n in nodes if up_at[n] <= t]
        if candidates:
            node = rng.choice(candidates)
            back = t + rng.uniform(*down)
            up_at[node] = back
            events += [Event(round(t, 2), node, "kill"), Event(round(back, 2), node, "restart")]
        t += rng.uniform(*every)
    if bootstrap and seconds > 2 * down[1]:
        t = rng.uniform(0.25 * seconds, max(0.25 * seconds, 0.75 * seconds - down[1]))
        back = t + rng.uniform(*down)
        events += [
            Event(round(t, 2), BOOTSTRAP, "kill"),
            Event(round(back, 2), BOOTSTRAP, "restart"),
        ]
    return sorted(events, key=lambda e: (e.t, e.action != "restart", e.target))


# -- the timeline, from the nodes' logs ------------------------------------------------------------

_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ p2pdiloco[\w.]*: "
    r"(?:version (\d+) certified by|applied version (\d+) )"
)


def certified_times(logs: Iterable[str]) -> dict[int, float]:
    """Version → the earliest wall-clock time (epoch s, the logs' local time) any log says it was
    certified (a syncer's ``version N certified by``) or applied (``applied version N``)."""
    times: dict[int, float] = {}
    for text in logs:
        for line in text.splitlines():
            m = _LINE.match(line)
            if m is None:
                continue
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            v = int(m.group(2) or m.group(3))
            times[v] = min(t, times.get(v, t))
    return times


@dataclass(frozen=True)
class Gap:
    after: int  # the version certified at the gap's start (or held when the chaos began)
    before: int | None  # the next certified version; None: none came before the end
    start: float  # seconds after the chaos began
    seconds: float


def gaps(cert_times: Mapping[int, float], start: float, end: float) -> list[Gap]:
    """The gaps between consecutive certified versions inside [start, end] (epoch seconds), the
    first from ``start`` and the last up to ``end`` (open: ``before`` is None)."""
    before_start = [v for v, t in cert_times.items() if t <= start]
    prev_v, prev_t = (max(before_start) if before_start else 0), start
    out = []
    for v, t in sorted(cert_times.items(), key=lambda kv: kv[1]):
        if start < t <= end and v > prev_v:
            out.append(Gap(prev_v, v, round(prev_t - start, 2), round(t - prev_t, 2)))
            prev_v, prev_t = v, t
    out.append(Gap(prev_v, None, round(prev_t - start, 2), round(end - prev_t, 2)))
    return out


def most_out_at_once(
    out: Mapping[str, Sequence[tuple[float, float]]], start: float, end: float
) -> int:
    """The most nodes out at one instant of [start, end]; ``out``: each node's (from, to)
    intervals of being out (killed, exited, or restarted but not yet at the newest version)."""
    edges = sorted(
        (t, step)
        for spans in out.values()
        for a, b in spans
        if a < end and b > start
        for t, step in ((max(a, start), 1), (min(b, end), -1))
    )
    most = now = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        now += step
        most = max(most, now)
    return most


def stall_allowance(manifest: RunManifest, failed_views: int = 1) -> float:
    """Seconds between two certificates when ``failed_views`` views of the round time out and
    the next certifies: the pacemaker's timeouts of views 0 to ``failed_views``, each twice the
    one before and at most ``view_timeout_max`` (ADR 0055). A round's grace and a silent
    leader's agree_timeout fall inside its view's timeout (the manifest requires it)."""
    return view_start(manifest.rules, failed_views + 1)


# -- a state directory against its certificates ----------------------------------------------------


@dataclass
class StateReport:
    chain_end: int = 0  # newest version of the unbroken chain verified from genesis
    contents: dict[int, str] = field(default_factory=dict)  # version → content digest (verified)
    tokens: dict[int, int] = field(default_factory=dict)  # version → tokens its receipts credit
    checkpoints: list[int] = field(default_factory=list)  # versions whose checkpoint verified
    resumes_from: int | None = None  # what ChainStore.restore hands a restarted node
    problems: list[str] = field(default_factory=list)  # each a corrupt-state finding


def verify_state_dir(state_dir: Path, run_id: str, manifest: RunManifest) -> StateReport:
    """Check one node's ``state/`` as the definitions above say; never raises on bad content."""
    rep = StateReport()
    files: dict[int, Path] = {}
    for path in sorted((state_dir / "certs").glob("*.json")):
        if path.stem.isdigit():
            files[int(path.stem)] = path
        else:
            rep.problems.append(f"certs/{path.name}: not a certificate file name")
    prev: Certificate | None = None
    for v in range(1, max(files, default=0) + 1):
        if v not in files:
            rep.problems.append(f"certs: no certificate for version {v}, yet later ones are held")
            break
        try:
            prev = verify_next(run_id, manifest, prev, files[v].read_bytes())
        except InvalidRecord as e:
            rep.problems.append(f"certs/{files[v].name}: {e}")
            break
        rep.chain_end, rep.contents[v] = v, content_digest(prev.body)
        rep.tokens[v] = sum(a.tokens for a in prev.body.accepted)
    store = CheckpointStore(state_dir / "certified")
    for v in sorted(store.versions()):
        _check_checkpoint(store.path_for(v), v, run_id, files, rep)
    _check_latest(state_dir, run_id, store, rep)
    return rep


def _check_checkpoint(
    path: Path, v: int, run_id: str, files: Mapping[int, Path], rep: StateReport
) -> None:
    name = f"certified/{path.name}"
    try:
        ckpt = load_checkpoint(path, verify=True)
        cert = parse_certificate(str(ckpt.meta["cert"]).encode(), run_id=run_id)
        state = CertifiedState.from_tensors(v, cert, ckpt.tensors)
    except (CheckpointError, InvalidRecord, KeyError, ValueError) as e:
        rep.problems.append(f"{name}: {str(e).splitlines()[0]}")
        return
    if cert.body.version != v:
        rep.problems.append(f"{name}: holds the certificate of version {cert.body.version}")
    elif state.state_hash != cert.body.state_hash:
        rep.problems.append(f"{name}: tensors do not hash to the certificate's state_hash")
    elif v in files and _content(files[v], run_id) != content_digest(cert.body):
        rep.problems.append(f"{name}: its certificate differs from certs/{v:08d}.json")
    else:
        rep.checkpoints.append(v)


def _content(path: Path, run_id: str) -> str | None:
    try:
        return content_digest(parse_certificate(path.read_bytes(), run_id=run_id).body)
    except InvalidRecord:
        return None


def _check_latest(state_dir: Path, run_id: str, store: CheckpointStore, rep: StateReport) -> None:
    pointer = store.directory / store.LATEST
    if not pointer.exists():
        if store.versions():
            rep.problems.append("certified/LATEST is missing beside checkpoints")
        return
    try:
        latest = json.loads(pointer.read_text())
        named = int(latest["version"])
    except (OSError, ValueError, KeyError, TypeError):
        rep.problems.append("certified/LATEST is unreadable")
        return
    if named not in rep.checkpoints:
        rep.problems.append(f"certified/LATEST names version {named}, not a valid checkpoint")
    restored = ChainStore(state_dir, run_id).restore()
    rep.resumes_from = restored.version if restored is not None else None
    if rep.resumes_from != named:
        rep.problems.append(f"a restart would resume from {rep.resumes_from}, LATEST says {named}")


# -- across nodes ----------------------------------------------------------------------------------


def lost_versions(
    reports: Mapping[str, StateReport],
    seen_certified: Iterable[int],
    applied: Mapping[str, int],
) -> dict[str, list[Any]]:
    """``lost``: versions certified during the run that fail (a)-(c) of the module docstring;
    ``forks``: versions certified with different contents; ``forgotten``: (node, its chain end,
    the version it had applied) for a node whose final chain is shorter than what it applied."""
    contents: dict[int, set[str]] = {}
    for rep in reports.values():
        for v, digest in rep.contents.items():
            contents.setdefault(v, set()).add(digest)
    forks = sorted(v for v, c in contents.items() if len(c) > 1)
    short = [
        (node, reports[node].chain_end, v)
        for node, v in sorted(applied.items())
        if node in reports and reports[node].chain_end < v
    ]
    lost = {v for v in seen_certified if v not in contents} | set(forks)
    for _, end, v in short:
        lost |= set(range(end + 1, v + 1))
    forgotten = [list(x) for x in short]
    return {"lost": sorted(lost), "forks": forks, "forgotten": forgotten}


def credited_tokens(reports: Iterable[StateReport], after: int, upto: int) -> int:
    """Tokens the receipts of versions ``after`` + 1 … ``upto`` credit, summed over learners
    (each version's verified certificate, from whichever node holds it)."""
    tokens: dict[int, int] = {}
    for rep in reports:
        tokens |= rep.tokens
    return sum(n for v, n in tokens.items() if after < v <= upto)


def report_dict(rep: StateReport) -> dict[str, Any]:
    d = asdict(rep)
    del d["contents"], d["tokens"]
    return d
