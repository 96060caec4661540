"""The stall indicator as views: the tally's clock, its one line, the dashboard and the metrics."""

from __future__ import annotations

import io

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from p2pdiloco.dashboard.live import DashboardSnapshot, json_line, plain_line, render
from p2pdiloco.runtime.node_metrics import _NodeCollector
from p2pdiloco.runtime.status import Tally, stall_text

A, B, C = "12D3KooW" + "a" * 36 + "a1b2c3d4", "12D3KooW" + "b" * 44, "12D3KooW" + "c" * 44


def view(tally: Tally, now: float, statuses: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return tally.view(
        version=12,
        committee=(A, B, C),
        committee_version=13,
        me="me",
        rejections=(),
        statuses=statuses,
        now=now,
    )


def test_not_stalled_before_grace_plus_timeout_then_stalled_naming_what_it_waits_for() -> None:
    tally = Tally(stall_after=80.0)
    assert view(tally, now=1e6).stalled is None  # nothing sent: nothing awaited
    tally.on_sent()
    t0 = tally.waiting_since
    assert t0 is not None
    tally.on_sent()  # a re-send does not restart the clock
    assert tally.waiting_since == t0
    assert view(tally, now=t0 + 79.9).stalled is None
    v = view(tally, now=t0 + 95.0, statuses={A: "accepted", B: "error", C: "error"})
    assert v.stalled == (
        "stalled: no certificate for version 13 for 95 s (waiting on committee …a1b2c3d4, "
        f"…{B[-8:]}, …{C[-8:]}; unreachable: …{B[-8:]}, …{C[-8:]})"
    )
    assert v.stalled_s == 95.0
    assert sum("stalled: no certificate" in e for e in tally.events) == 1  # one event line
    view(tally, now=t0 + 96.0)
    assert sum("stalled: no certificate" in e for e in tally.events) == 1


def test_a_new_version_clears_the_stall() -> None:
    tally = Tally(stall_after=10.0)
    tally.on_sent()
    assert tally.waiting_since is not None
    assert view(tally, now=tally.waiting_since + 11).stalled is not None
    tally.record_chain([], "me")
    later = view(tally, now=1e9)
    assert later.stalled is None and later.stalled_s == 0.0


def test_stall_after_zero_never_stalls() -> None:
    tally = Tally()
    tally.on_sent()
    assert view(tally, now=1e12).stalled is None


def test_a_first_committee_none_of_whom_is_up_is_named_as_such() -> None:
    a, b = "12D3KooWaaaaaaaa1", "12D3KooWbbbbbbbb2"
    assert stall_text(1, 109.0, (a,), (a,)) == (
        "stalled: no certificate for version 1 for 109 s (waiting on committee …aaaaaaa1; "
        "unreachable: …aaaaaaa1; no member of the run's first committee is up: it starts once "
        "they join)"
    )
    # One member up, or a later version: what it waits on, no more.
    assert "first committee" not in stall_text(1, 109.0, (a, b), (a,))
    assert "first committee" not in stall_text(2, 109.0, (a,), (a,))


def test_stall_text_without_a_known_committee() -> None:
    assert stall_text(3, 12.4, ()) == (
        "stalled: no certificate for version 3 for 12 s (waiting on an unknown committee)"
    )


def _text(snap: DashboardSnapshot, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(render(snap))
    return console.export_text()


@pytest.mark.parametrize("width", [80, 120])
def test_dashboard_shows_the_stall_instead_of_next_sync_in_0s(width: int) -> None:
    snap = DashboardSnapshot.example_stalled()
    text = _text(snap, width)
    flat = " ".join(text.split())
    assert "stalled: no certificate for version 13 for 95 s" in flat
    assert "unreachable: …c3d4e5f6, …e5f6a7b8" in flat
    assert "next sync in" not in text
    assert all(len(line) <= width for line in text.splitlines())
    assert "next sync in" in _text(DashboardSnapshot.example(), width)  # healthy: the ETA


def test_plain_and_json_lines_carry_the_stall() -> None:
    snap = DashboardSnapshot.example_stalled()
    assert plain_line(snap).endswith(snap.stalled or "-")
    assert '"stalled": "stalled: no certificate for version 13' in json_line(snap)
    assert "stalled" not in plain_line(DashboardSnapshot.example())


def test_metrics_expose_stalled_and_its_seconds() -> None:
    base = {
        "version": 12,
        "tokens_per_second": 1500.0,
        "tokens_trained": 1,
        "tokens_accepted": 1,
        "sent": 1,
        "accepted": 1,
        "rejected": 0,
        "late": 0,
        "rounds": 12,
        "bytes_up": 1,
        "bytes_down": 1,
        "peers_direct": 1,
        "peers_relayed": 0,
        "on_committee": False,
    }
    for stalled, seconds, flag in ((None, 0.0, 0.0), ("stalled: no certificate ...", 95.0, 1.0)):
        reg = CollectorRegistry()
        s = {**base, "stalled": stalled, "stalled_seconds": seconds}
        reg.register(_NodeCollector(lambda s=s: s))  # type: ignore[misc]
        text = generate_latest(reg).decode()
        values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln[:1] != "#"}
        assert values["p2pdiloco_stalled"] == flag
        assert values["p2pdiloco_stalled_seconds"] == seconds
        assert values["p2pdiloco_tokens_per_second"] == 1500.0


def _heartbeat(version: int, stalled_s: float):  # type: ignore[no-untyped-def]
    from p2pdiloco.protocol.identity import Identity
    from p2pdiloco.protocol.records import Hardware, Heartbeat

    return Heartbeat(
        peer_id=Identity.generate().peer_id,
        island="i",
        roles=["learner"],
        hardware=Hardware(device="cpu", name="c", memory_gb=1.0, count=1),
        throughput_tps=1.0,
        version=version,
        addrs=[],
        gossip_addrs=[],
        reachability="direct",
        seq=1,
        stalled_s=stalled_s,
    )


def test_a_run_is_stalled_when_half_its_live_peers_say_so() -> None:
    from p2pdiloco.net.discovery import run_stall

    assert run_stall([]) is None
    assert run_stall([_heartbeat(12, 0.0), _heartbeat(12, 0.0)]) is None
    assert run_stall([_heartbeat(12, 95.0), _heartbeat(12, 0.0), _heartbeat(11, 0.0)]) is None
    assert run_stall([_heartbeat(12, 95.0), _heartbeat(12, 80.0), _heartbeat(11, 0.0)]) == (
        "no certificate for version 13 for 95 s (2 of 3 live peers waiting)"
    )


def test_status_and_the_bootstrap_page_show_a_stalled_run() -> None:
    from p2pdiloco.dashboard.status import status_view
    from p2pdiloco.net.web_page import render_page

    run = {
        "run_id": "ab" * 32,
        "name": "r",
        "model": "gemma-tiny",
        "peers": 3,
        "latest_version": 12,
        "throughput_tps": 0.0,
        "incompatible": None,
        "stalled": "no certificate for version 13 for 95 s (2 of 3 live peers waiting)",
    }
    state = {"time": 0.0, "runs": [run], "peers": [], "bootstraps": [], "rejected_records": []}
    console = Console(width=100, record=True, file=io.StringIO(), color_system=None)
    console.print(status_view(state, 100))
    flat = " ".join(console.export_text().split())
    assert f"run {'ab' * 6} stalled: no certificate for version 13 for 95 s" in flat
    assert "stalled: no certificate for version 13 for 95 s" in render_page(state)
    healthy = {**state, "runs": [{**run, "stalled": None}]}
    assert "stalled" not in render_page(healthy)


def test_the_wait_from_send_to_certificate_is_summed_over_versions() -> None:
    import time

    tally = Tally(stall_after=100.0)
    tally.on_sent()
    tally.waiting_since = time.monotonic() - 5.0  # sent 5 s ago
    tally.record_chain([], "me")
    assert 5.0 <= tally.sync_wait_s < 6.0
    tally.record_chain([], "me")  # a version with nothing sent adds nothing
    assert tally.sync_wait_s < 6.0
    assert view(tally, time.monotonic()).sync_wait_s == round(tally.sync_wait_s, 2)
