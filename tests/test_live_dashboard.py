"""The ``join`` dashboard at pinned widths: every field shown, nothing past the edge, no markup."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from p2pdiloco.dashboard.live import (
    BLOCKS,
    DashboardSnapshot,
    format_duration,
    json_line,
    last_synced,
    plain_line,
    render,
    save_screenshot,
    sparkline,
)


def text_of(snap: DashboardSnapshot, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(render(snap))
    return console.export_text()


def assert_fits(text: str, width: int) -> None:
    too_long = [line for line in text.splitlines() if len(line) > width]
    assert not too_long, too_long
    assert "…" not in text


@pytest.mark.parametrize("width", [80, 100, 120])
def test_example_shows_every_field(width: int) -> None:
    snap = DashboardSnapshot.example()
    text = text_of(snap, width)
    assert_fits(text, width)
    needles = [
        snap.peer_id,
        "wikitext-demo",
        "(3f9a2c1b)",  # run id prefix
        "gemma-tiny",
        "training",
        "version 12",
        "12/20 steps",
        "next sync in 1m05s",
        "1.23k tok/s",
        sparkline(snap.loss_local),
        "local 2.710",
        "global eval 2.930",
        "3 direct, 1 relayed",
        "Islands",
        "Reachability  direct",
        "syncer (leader) for version 12",
        "↑ 12.3 MiB (45.0 KiB/s)",
        "↓ 98.7 MiB (210.3 KiB/s)",
        "41 accepted",
        "2 rejected",
        "1.64M tokens",
        "18.4% of the run",
        "#2 of 7",
        "12:03:22 elected syncer (leader) for version 12",
    ]
    for needle in needles:
        assert needle in text, needle
    assert any(ch in text for ch in BLOCKS)
    # 14 of 24 cells filled for 12/20 steps
    assert "━" * 14 + "─" * 10 + " 12/20" in text


def test_only_the_last_five_events_are_shown() -> None:
    snap = DashboardSnapshot.example()
    text = text_of(snap, 80)
    assert snap.events[0] not in text
    shown = [text.index(e) for e in snap.events[-5:]]
    assert shown == sorted(shown)  # newest last


def test_paused_shows_the_reason() -> None:
    snap = DashboardSnapshot.example_paused()
    for width in (80, 120):
        text = text_of(snap, width)
        assert_fits(text, width)
        assert "paused" in text and "network lost, retrying in 8 s" in text
        assert "next sync time unknown" in text and "0 direct, 0 relayed" in text


def test_a_learner_of_a_fragmented_run_sees_its_fragments() -> None:
    """Version 10 of four fragments: the round on 10 syncs fragment 10 mod 4 (the third);
    version v synced fragment (v − 1) mod 4, so the last ones were 9, 10, 7 and 8."""
    snap = dataclasses.replace(DashboardSnapshot.example(), version=10, fragments=4, fragment=2)
    for width in (80, 120):
        text = text_of(snap, width)
        assert_fits(text, width)
        assert "syncing 3 of 4" in text and "1:v9 2:v10 3:v7 4:v8" in text
    assert "fragment 3/4" in plain_line(snap)
    assert "Fragments" not in text_of(DashboardSnapshot.example(), 100)  # P = 1: no row
    assert [last_synced(2, f, 4) for f in range(4)] == [1, 2, None, None]


def test_a_bare_snapshot_renders() -> None:
    snap = DashboardSnapshot(peer_id="12D3KooWabc")
    text = text_of(snap, 80)
    assert_fits(text, 80)
    for needle in (
        "12D3KooWabc",
        "no run yet",
        "connecting",
        "version 0",
        "0/0 steps",
        "no local loss yet",
        "no global eval yet",
        "not ranked yet",
        "no events yet",
        "0 B (0 B/s)",
    ):
        assert needle in text, needle


def test_a_long_unbroken_event_wraps_inside_the_width() -> None:
    snap = DashboardSnapshot.example()
    snap.events.append("x" * 300)
    snap.committee_duty = "syncer " * 30
    for width in (80, 120):
        assert_fits(text_of(snap, width), width)


def test_peer_strings_cannot_inject_markup_or_escapes() -> None:
    snap = DashboardSnapshot.example()
    snap.events.append("[bold red]x[/]")
    snap.run_name = "[link=http://evil]run[/link]"
    snap.model = "gemma\x1b[2J\x1b[31m-tiny\nFAKE"
    console = Console(width=100, record=True, file=io.StringIO(), force_terminal=True)
    console.print(render(snap))
    text = console.export_text()
    assert "[bold red]x[/]" in text
    assert "[link=http://evil]run[/link]" in text
    assert "\x1b" not in text and "gemma\ufffd[2J\ufffd[31m-tiny FAKE" in text
    line = plain_line(dataclasses.replace(snap, state="paused", paused_reason="a\nb\x1bc"))
    assert "\n" not in line and "\x1b" not in line


def test_sparkline() -> None:
    assert sparkline([]) == ""
    assert sparkline([math.nan, math.inf]) == ""
    assert sparkline([1.0, 2.0, 3.0], width=0) == ""
    assert sparkline([2.0] * 5) == "▄" * 5
    assert sparkline([0.0, 7.0]) == "▁█"
    assert sparkline([float(i) for i in range(8)]) == BLOCKS
    assert sparkline([0.0, math.nan, 1.0, -math.inf, 0.5]) == "▁█▅"
    assert sparkline([float(i) for i in range(100)], width=10) == "▁▂▃▃▄▅▆▆▇█"
    assert len(sparkline([float(i % 7) for i in range(100)])) == 24


def test_format_duration() -> None:
    assert [format_duration(s) for s in (-3, 0, 42.4, 65, 3599, 7380)] == [
        "0s",
        "0s",
        "42s",
        "1m05s",
        "59m59s",
        "2h03m",
    ]


def test_plain_line() -> None:
    line = plain_line(DashboardSnapshot.example())
    assert "\n" not in line
    for needle in (
        "[training]",
        "version 12",
        "step 12/20",
        "1.23k tok/s",
        "loss 2.710",
        "3 direct 1 relayed",
        "41 accepted",
        "2 rejected",
    ):
        assert needle in line, needle
    paused = plain_line(DashboardSnapshot.example_paused())
    assert "[paused: network lost, retrying in 8 s]" in paused
    assert "loss -" in plain_line(DashboardSnapshot(peer_id="p"))


def test_json_line_round_trips_and_stays_valid() -> None:
    snap = DashboardSnapshot.example()
    line = json_line(snap)
    assert "\n" not in line
    assert json.loads(line) == dataclasses.asdict(snap)
    snap.loss_local = [1.0, math.nan, math.inf]
    snap.tokens_per_second = math.nan
    data = json.loads(json_line(snap))
    assert data["loss_local"] == [1.0, None, None] and data["tokens_per_second"] is None


def test_save_screenshot(tmp_path: Path) -> None:
    path = tmp_path / "img" / "dash.svg"
    save_screenshot(path)
    svg = path.read_text()
    assert "<svg" in svg and "p2pdiloco" in svg  # spaces are written as &#160;
    save_screenshot(path, DashboardSnapshot.example_paused(), width=80)
    assert "<svg" in path.read_text()
