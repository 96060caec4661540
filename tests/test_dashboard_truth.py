"""The dashboard tells the truth (issue 39 item 4), from the views a node publishes to the text.

Each test builds the plain-data views (``TrainerView``, ``RuntimeView``, the node's snapshot),
runs them through ``NodeView`` and renders the result: the stretch's steps with overtime shown
as such, a countdown or what the node waits on, late deltas apart from rejected ones (the
rejected count being the leaderboard's), and islands counted as islands.
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from rich.console import Console

from p2pdiloco.core.learner import LearnerMachine, Send
from p2pdiloco.core.ledger import build_ledger
from p2pdiloco.core.roster import committee_for, next_roster, roster_of, with_roster
from p2pdiloco.dashboard.live import DashboardSnapshot, plain_line, render
from p2pdiloco.protocol.certificates import (
    Accepted,
    Certificate,
    CertificateBody,
    Rejected,
    assemble,
    parse_certificate,
    roster_digest,
    sign_body,
)
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.runtime.node_view import NodeView
from p2pdiloco.runtime.status import RuntimeView, Tally
from p2pdiloco.runtime.trainer import TrainerView
from tests.test_ledger import BY_ID, LEARNERS, MANIFEST, RUN_ID, receipt

ME = "12D3KooWMe" + "x" * 42


@dataclass
class FakeNode:
    """What ``Node.snapshot()`` publishes, as plain data."""

    island: str = "island-xxxxxx"
    peers: list[dict[str, Any]] = field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        return {
            "peer_id": ME,
            "run_id": "ab" * 32,
            "run_name": "truth",
            "model": "gemma-tiny",
            "reachability": "direct",
            "island": self.island,
            "peers": [{"peer_id": ME, "reachability": "direct", "island": self.island}]
            + self.peers,
            "events": (),
        }


@dataclass
class FakeRunning:
    """``RunningNode.views()`` and its manifest."""

    runtime: RuntimeView
    trainer: TrainerView | None
    manifest: Any = MANIFEST

    def views(self) -> tuple[RuntimeView, TrainerView | None]:
        return self.runtime, self.trainer


def snapshot(rv: RuntimeView, tv: TrainerView | None, node: FakeNode | None = None) -> Any:
    return NodeView(node or FakeNode(), FakeRunning(rv, tv)).snapshot()  # type: ignore[arg-type]


def text_of(snap: DashboardSnapshot, width: int = 100) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(render(snap))
    return console.export_text()


def test_progress_counts_the_stretch_and_shows_overtime() -> None:
    """A learner whose delta is in flight trains on: its stretch's steps count from that send,
    and steps past the stretch are shown as overtime, not hidden at H/H."""
    training = TrainerView(phase="waiting for certificate", inner_step=7, stretch_steps=20)
    snap = snapshot(RuntimeView(version=12), training)
    assert (snap.inner_step, snap.inner_steps, snap.overtime_steps) == (7, 20, 0)
    assert snap.state == "training, delta in flight"  # not "waiting for certificate"
    assert "7/20 steps" in text_of(snap) and "overtime" not in text_of(snap)

    over = TrainerView(
        phase="training on (stretch done)", inner_step=27, stretch_steps=20, overtime=7
    )
    snap = snapshot(RuntimeView(version=12), over)
    assert (snap.inner_step, snap.overtime_steps) == (20, 7)
    assert snap.state == "overtime, awaiting certificate"
    assert "20/20 steps +7 overtime" in text_of(snap)
    assert "step 20/20 +7 overtime" in plain_line(snap)


def test_next_sync_is_a_countdown_or_says_what_the_node_waits_on() -> None:
    now = time.monotonic()
    # 30 s were due when the trainer last published, 10 s ago: 20 s are left, and it counts
    # down between the trainer's publications.
    tv = TrainerView(
        phase="training", inner_step=5, stretch_steps=20, due_s=30.0, published_at=now - 10
    )
    snap = snapshot(RuntimeView(version=12), tv)
    assert snap.eta_seconds is not None and 18.0 <= snap.eta_seconds <= 20.0
    assert "next sync in 2" in text_of(snap)  # 20s or 19s
    later = snapshot(RuntimeView(version=12), tv)
    assert later.eta_seconds is not None and later.eta_seconds <= snap.eta_seconds

    # A delta in flight: the countdown to the next one, and the certificate awaited.
    rv = RuntimeView(version=12, waiting_since=now - 8)
    snap = snapshot(
        rv,
        TrainerView(
            phase="waiting for certificate", stretch_steps=20, due_s=40.0, published_at=now
        ),
    )
    assert snap.waiting_on == "certificate for version 13" and 8 <= snap.waiting_seconds < 10
    assert "next sync in 40s · awaiting certificate for version 13 (8s)" in text_of(snap, 120)

    # Overtime: no countdown (the next delta waits for that certificate), only what it awaits.
    rv = RuntimeView(version=12, waiting_since=now - 25)
    over = TrainerView(phase="training on (stretch done)", inner_step=22, stretch_steps=20)
    snap = snapshot(rv, over)
    assert snap.eta_seconds is None
    assert "awaiting certificate for version 13 (25s)" in text_of(snap)
    assert "next sync" not in text_of(snap)
    assert "awaiting certificate for version 13 (25s)" in plain_line(snap)


def successor(
    prev: Certificate | None, accepted: list[Accepted], rejected: list[Rejected]
) -> Certificate:
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
        rejected=sorted(rejected, key=lambda r: r.digest),
        roster_hash=roster_digest(
            next_roster(roster_of(MANIFEST, prev), new_version=info.version, accepted=accepted)
        ),
    )
    signers = [BY_ID[p] for p in body.committee if p in BY_ID]
    raw = assemble(body, {s.peer_id: sign_body(s, body) for s in signers})
    return with_roster(MANIFEST, prev, parse_certificate(raw))


def digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def test_late_deltas_are_counted_apart_from_rejected_ones_and_match_the_leaderboard() -> None:
    me, other = LEARNERS[0], LEARNERS[1]
    # The learner: delta A is refused as late and left out of version 1's certificate; delta B
    # is screened out by version 2's; delta C is given up.
    m = LearnerMachine(inner_steps=2, chunk=2, version=0, give_up_after=10.0)
    for name, version in (("A", 1), ("B", 2)):
        m.on_trained(2, 1.0)
        assert isinstance(m.next_action(0.0)[0], Send)
        m.on_sent(digest(name))
        if name == "A":
            assert m.on_reply(digest("A"), False, Reason.ROUND_CLOSED, None) == []
        rejected = frozenset({digest("B")}) if name == "B" else frozenset()
        m.on_certified(version, frozenset(), rejected=rejected)
    m.on_trained(2, 1.0)
    m.next_action(100.0)
    m.on_sent(digest("C"))
    m.on_trained(2, 1.0)  # a stretch since: overtime, and the delta is given up
    m.next_action(200.0)
    assert m.lost == 3 and m.late == {Reason.ROUND_CLOSED: 2}

    # The certificates: version 1 merges the other learner's delta only, version 2 rejects B.
    screened = Rejected(peer_id=me, digest=digest("B"), reason=Reason.SCREENED_OUT)
    v1 = successor(None, [receipt(other, 100, 1)], [])
    v2 = successor(v1, [receipt(other, 100, 2)], [screened])
    v3 = successor(v2, [receipt(me, 50, 3), receipt(other, 100, 3)], [])
    tally = Tally()
    merged, rejected = tally.record_chain([v1, v2, v3], me)
    assert rejected == {digest("B")} and receipt(me, 50, 3).digest in merged
    board = {
        p["peer_id"]: p
        for p in build_ledger(RUN_ID, MANIFEST, [v1.raw, v2.raw, v3.raw]).to_dict()["peers"]
    }

    tv = TrainerView(
        phase="training",
        lost=m.lost,
        late=tuple((code.value, n) for code, n in m.late.items()),
    )
    rv = tally.view(version=3, committee=(), committee_version=0, me=me, rejections=())
    snap = snapshot(rv, tv)
    assert (
        (snap.accepted, snap.rejected) == (board[me]["accepted"], board[me]["rejected"]) == (1, 1)
    )
    assert snap.rejected_reasons == board[me]["reasons"] == {"screened_out": 1}
    assert snap.late == 2 and snap.late_reasons == {"round_closed": 2}
    text = text_of(snap)
    assert "Deltas    1 accepted, 1 rejected" in text
    assert "Rejected  screened_out 1" in text and "Late      2 (round_closed 2)" in text
    assert "1 accepted 1 rejected (screened_out 1) 2 late (round_closed 2)" in plain_line(snap)

    # A restart loads the same counts from the kept certificates (``Tally.load_ledger``).
    fresh = Tally()
    fresh.load_ledger(build_ledger(RUN_ID, MANIFEST, [v1.raw, v2.raw, v3.raw]), me)
    assert (fresh.accepted, fresh.rejected, fresh.rejected_reasons) == (1, 1, {"screened_out": 1})


@pytest.mark.parametrize(
    ("own", "islands", "expected"),
    [
        ("island-aaaaaa", ["island-bbbbbb", "island-cccccc", "island-dddddd"], 4),  # the default
        ("host", ["host", "host", "host"], 1),  # one name for all: one island, not two
        ("lan", ["lan", "island-bbbbbb", ""], 3),  # a peer announcing no name is its own
    ],
)
def test_islands_are_counted_as_islands(own: str, islands: list[str], expected: int) -> None:
    peers = [
        {"peer_id": f"12D3KooWPeer{i}" + "y" * 40, "reachability": "direct", "island": name}
        for i, name in enumerate(islands)
    ]
    snap = snapshot(RuntimeView(), None, FakeNode(island=own, peers=peers))
    assert snap.peers_direct == 3 and snap.islands == expected
    assert f"Islands       {expected}" in text_of(snap)
