"""The certified loss curve (ADR 0059) from the verified chain only: ``core.curve``, the
bootstrap's page (inline SVG, checked with the stdlib HTML parser), ``status --curve``."""

from __future__ import annotations

import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rich.console import Console

from p2pdiloco.core.curve import LossCurve, loss_curve
from p2pdiloco.core.roster import committee_for, next_roster, roster_of, with_roster
from p2pdiloco.dashboard.status import curve_view
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.net.observe import NetworkWatch
from p2pdiloco.net.web_page import render_page
from p2pdiloco.protocol.certificates import (
    Accepted,
    Certificate,
    CertificateBody,
    assemble,
    parse_certificate,
    roster_digest,
    sign_body,
)
from tests.netutil import run_cli as forked_cli
from tests.test_ledger import BY_ID, LEARNERS, SYNCERS, forged, receipt

RUN_ID, MANIFEST, MANIFEST_RAW = create_manifest(
    SYNCERS[0],
    name="curve",
    model="gemma-tiny",
    data="embedded",
    seed=0,
    inner_steps=10,
    committee_size=4,
    genesis_committee=[s.peer_id for s in SYNCERS],
    held_out={"batches": 2},
    plan={"rounds": 3, "tokens": 3 * 4 * 10 * 8 * 128, "learners": 4},
    inner={"total_steps": 30, "warmup_steps": 3},
)
LOSSES = [5.5, 4.25, 3.5, 3.125]


def evaluated(prev: Certificate | None, accepted: list[Accepted], loss: float) -> Certificate:
    """The verified successor of ``prev`` carrying the eval loss ``loss``, signed by all four."""
    info = committee_for(RUN_ID, MANIFEST, prev)
    accepted = sorted(accepted, key=lambda a: a.digest)
    body = CertificateBody(
        run=RUN_ID,
        version=info.version,
        base_version=info.version - 1,
        state_hash="cd" * 32,
        committee=list(info.members),
        quorum=info.quorum,
        accepted=accepted,
        roster_hash=roster_digest(
            next_roster(roster_of(MANIFEST, prev), new_version=info.version, accepted=accepted)
        ),
        eval_loss=loss,
    )
    raw = assemble(body, {p: sign_body(BY_ID[p], body) for p in body.committee})
    return with_roster(MANIFEST, prev, parse_certificate(raw))


def chain(versions: int = len(LOSSES)) -> list[Certificate]:
    out: list[Certificate] = []
    for v in range(1, versions + 1):
        accepted = [receipt(p, 1000, v) for p in LEARNERS]
        out.append(evaluated(out[-1] if out else None, accepted, LOSSES[v - 1]))
    return out


def test_the_curve_counts_tokens_and_thins_evenly_when_long() -> None:
    curve = loss_curve(chain())
    assert [(p.version, p.tokens, p.eval_loss) for p in curve.points] == [
        (v, 3000 * v, LOSSES[v - 1]) for v in range(1, 5)
    ]
    long = LossCurve(max_points=8)
    for c in chain():
        long.add(c.body)
    body = chain(1)[0].body
    for v in range(5, 40):
        long.add(body.model_copy(update={"version": v, "eval_loss": 1.0 + 1 / v}))
    assert len(long.points) <= 8 and long.points[-1].version == 39 and long.version == 39
    versions = [p.version for p in long.points]
    assert versions == sorted(versions) and versions[0] <= 8  # still spans the whole run


class Page(HTMLParser):
    """Every start tag with its attributes, and the text inside ``figcaption``."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.captions: list[str] = []
        self._caption = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._caption = self._caption or tag == "figcaption"

    def handle_endtag(self, tag: str) -> None:
        self._caption = self._caption and tag != "figcaption"

    def handle_data(self, data: str) -> None:
        if self._caption:
            self.captions.append(data)


def test_the_page_draws_only_the_verified_chain_as_inline_svg() -> None:
    watch = NetworkWatch()
    watch.follow(RUN_ID, MANIFEST)
    honest = chain()
    lie = forged(honest[3], LEARNERS[0], 10**12)  # an edited receipt: its signatures break
    watch.add_certificates(RUN_ID, [c.raw for c in honest[:3]] + [lie])
    assert [p["eval_loss"] for p in watch.curve(RUN_ID)] == LOSSES[:3]
    name = '<script>alert("x")</script>'
    state = {
        "runs": [{"run_id": RUN_ID, "name": name}],
        "peers": [],
        "curves": {RUN_ID: watch.curve(RUN_ID)},
    }
    body = render_page(state)
    page = Page()
    page.feed(body)
    tags = [t for t, _ in page.tags]
    assert "script" not in tags and "<script>" not in body  # the run's name is text only
    figure = next(a for t, a in page.tags if t == "figure")
    assert figure["id"] == f"curve-{RUN_ID[:12]}"
    svg = next(a for t, a in page.tags if t == "svg")
    assert svg["xmlns"] == "http://www.w3.org/2000/svg" and svg["viewbox"]
    (line,) = [a for t, a in page.tags if t == "polyline"]
    assert line["points"] is not None
    xy = [tuple(map(float, p.split(","))) for p in line["points"].split()]
    assert len(xy) == 3
    xs, ys = [x for x, _ in xy], [y for _, y in xy]
    assert xs == sorted(xs) and xs[0] < xs[-1]  # tokens grow to the right
    assert ys == sorted(ys) and ys[0] < ys[-1]  # the loss falls: lower on the page
    caption = "".join(page.captions)
    assert "eval loss 3.5000 at version 3" in caption and "9,000 tokens" in caption
    no_curves = render_page({"runs": state["runs"], "peers": [], "curves": {RUN_ID: []}})
    assert "<svg" not in no_curves


@pytest.mark.skipif(
    not (shutil.which("chromium") or shutil.which("chromium-browser")),
    reason="no Chromium on this machine: the HTML parser test above checks the page",
)
def test_chromium_renders_the_curve(tmp_path: Path) -> None:
    import subprocess

    watch = NetworkWatch()
    watch.follow(RUN_ID, MANIFEST)
    watch.add_certificates(RUN_ID, [c.raw for c in chain()])
    html = render_page(
        {"runs": [{"run_id": RUN_ID, "name": "c"}], "peers": [], "curves": {"x": []}}
        | {"curves": {RUN_ID: watch.curve(RUN_ID)}}
    )
    page = tmp_path / "page.html"
    page.write_text(html)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser is not None
    out = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "<polyline" in out.stdout and "<script" not in out.stdout


def test_status_curve_from_a_state_directory_says_a_run_went_past_its_plan(
    tmp_path: Path,
) -> None:
    (tmp_path / "certs").mkdir()
    (tmp_path / "manifest.json").write_bytes(MANIFEST_RAW)
    honest = chain()
    for c in honest[:3]:
        (tmp_path / "certs" / f"{c.body.version:08d}.json").write_bytes(c.raw)
    (tmp_path / "certs" / "00000004.json").write_bytes(honest[3].raw)
    out = forked_cli("status", "--curve", "--state-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    curve = json.loads(out.stdout)
    assert curve["versions"] == 4 and curve["tokens"] == 12000
    assert [p["eval_loss"] for p in curve["points"]] == LOSSES
    assert curve["planned_rounds"] == 3 and curve["past_plan"]  # 4 versions of a 3-round plan
    console = Console(width=100, record=True)
    console.print(curve_view(curve, 100))
    text = console.export_text()
    assert "5.5000 → 3.1250" in text and "12,000" in text
    assert "past its planned 3 rounds" in text
    console = Console(width=100, record=True)
    console.print(curve_view({**curve, "versions": 3, "past_plan": False, "points": []}, 100))
    assert "no certificate carries an eval loss yet" in console.export_text()
