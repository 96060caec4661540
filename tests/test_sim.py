"""The network simulator (``p2pdiloco.sim``): reproducible, sane figures, and the protocol's
guarantees held on simulated time (quorum certificates, view changes, faulty syncers)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import pytest

from p2pdiloco.core.delivery import Delivery
from p2pdiloco.core.roster import committee_for
from p2pdiloco.core.round import Submission
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.sim import SimConfig, simulate_run
from p2pdiloco.sim.config import Fault, fault_schedule, profiles
from p2pdiloco.sim.dp import data_parallel, up_seconds
from p2pdiloco.sim.learner import Pending, SimLearner

SMALL = SimConfig(
    peers=12,
    committee_size=4,
    duration=1800.0,
    inner_steps=50,
    seed=3,
    rules={"grace": 30.0, "agree_timeout": 10.0},
)


def _figures(cfg: SimConfig) -> dict[str, object]:
    result, _ = simulate_run(cfg)
    out = result.to_dict()
    out.pop("wall_seconds")
    return out


def test_a_seed_gives_the_same_run_twice() -> None:
    cfg = replace(SMALL, mtbf_hours=2.0, churn_per_hour=0.5)
    assert _figures(cfg) == _figures(cfg)


def test_overtime_replayed_at_events_gives_the_figures_of_an_event_a_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Learners in overtime (their stretch done, a delta in flight) wake only when something
    reaches them and replay the chunks since (``sim.learner.Overtime``): the same run as
    an event a chunk, with failures, churn and fragments (budgeted stretches of a few steps,
    so most of a learner's time is overtime), in far fewer events."""
    cfg = replace(
        SMALL,
        peers=40,
        fragments=10,
        mtbf_hours=2.0,
        churn_per_hour=0.5,
        rules={"grace": 60.0, "linger": 20.0},
    )
    fast, fast_world = simulate_run(cfg)
    monkeypatch.setattr(SimLearner, "replay_overtime", False)
    slow, slow_world = simulate_run(cfg)
    assert fast.versions > 20 and fast.faults > 0, fast
    assert fast.events < 0.9 * slow.events
    got, want = fast.to_dict(), slow.to_dict()
    for key in ("wall_seconds", "events"):
        got.pop(key), want.pop(key)
    # Latencies are differences of event times, which are sums taken in another order (the
    # pacemaker's view times, ADR 0055, add terms): equal to a nanosecond in seconds.
    for key in ("latency_p50", "latency_p95", "latency_p99"):
        assert got.pop(key) == pytest.approx(want.pop(key), rel=1e-10)
    assert got == want
    assert [c.content for c in fast_world.certs] == [c.content for c in slow_world.certs]


def test_without_faults_nearly_all_trained_work_is_certified() -> None:
    result, world = simulate_run(replace(SMALL, duration=3600.0))
    # Each delta is uploaded once, to one member, which relays it (ADR 0028): with nobody
    # down, learners upload at most one payload per delta (members' own deltas: none).
    assert 0 < world.learner_up <= world.deltas_sent * world.cfg.payload_bytes
    assert world.relayed > 0
    assert result.versions >= 40 and result.view_changes == 0
    assert result.goodput > 0.95, result
    assert result.data_parallel is not None and result.data_parallel.goodput == pytest.approx(1.0)
    # Both methods count the same hardware.
    assert result.capacity_tokens == pytest.approx(result.data_parallel.capacity_tokens)
    # Every version was certified by a quorum of its own committee, in order.
    assert [c.version for c in world.certs] == list(range(1, result.versions + 1))
    assert result.wrong_certificates == 0 and result.conflicts == 0
    # Learners download each certificate beside its update: its size grows with its receipts.
    sizes = {len(c.merged): c.nbytes for c in world.certs}
    few, most = min(sizes), max(sizes)
    assert few < most and sizes[few] < sizes[most] == result.certificate_bytes_max


def test_failures_cost_diloco_its_own_work_and_stall_data_parallel() -> None:
    result, _ = simulate_run(replace(SMALL, duration=3600.0, mtbf_hours=3.0, repair_seconds=300))
    dp = result.data_parallel
    assert dp is not None and dp.stalls > 0
    assert result.faults > 0
    assert result.goodput > 0.85 and result.goodput > dp.goodput + 0.2, (result, dp)


def test_a_committee_that_loses_its_members_hands_the_version_to_the_next_view() -> None:
    # Failures long enough that committee members are down when their round is due (since
    # ADR 0055 a short committee's quorum rides out what MTBF 0.5 h did at this seed: harsher).
    cfg = replace(SMALL, duration=3600.0, mtbf_hours=0.25, repair_seconds=900, seed=5)
    result, world = simulate_run(cfg, baseline=False)
    assert result.view_changes > 0
    assert any(c.view > 0 for c in world.certs)  # certified by a later view's committee
    assert result.versions >= 10 and result.conflicts == 0 and result.wrong_certificates == 0


def test_faulty_syncers_below_a_third_never_get_a_wrong_state_certified() -> None:
    """The guarantee is per committee: a committee with fewer faulty members than its quorum
    never certifies a wrong state. A quarter of the population faulty means a random draw of
    seven can seat a quorum of them (about 0.3 % of draws): then the assumption is broken, and
    the simulator says so (the wrong certificate is counted), as the k = 1 test below shows."""
    quorum = 5  # of k = 7
    cfg = replace(SMALL, peers=24, committee_size=7, faulty_syncers=0.25, seed=11)
    result, world = simulate_run(cfg, baseline=False)
    faulty = {p.peer_id for p in world.profiles if p.faulty}
    sat = [c for c in world.certs if faulty & set(c.committee)]
    assert len(sat) >= 5, "the draw should seat faulty syncers on several committees"
    assert result.versions >= 20, result
    below = [c for c in world.certs if len(faulty & set(c.committee)) < quorum]
    assert len(below) >= 20 and all(not c.wrong for c in below)
    assert result.conflicts == 0
    assert all(not faulty & set(c.signers) for c in below)  # they signed another state
    assert result.wrong_certificates == len(world.certs) - len(below)  # only where broken


def test_a_committee_of_faulty_syncers_certifies_their_state_and_the_simulator_says_so() -> None:
    # k = 1: a faulty member alone is a quorum (the protocol's assumption is broken on purpose).
    cfg = replace(SMALL, committee_size=1, faulty_syncers=0.99, duration=600.0)
    result, _ = simulate_run(cfg, baseline=False)
    assert result.versions > 0 and result.wrong_certificates == result.versions
    assert result.goodput == 0.0


def test_data_parallel_loses_the_work_since_its_checkpoint_and_waits_for_the_repair() -> None:
    cfg = SimConfig(peers=4, duration=3600.0, mtbf_hours=1.0, repair_seconds=600, seed=1)
    import random

    rng = random.Random(cfg.seed)
    faults, count = fault_schedule(cfg, rng)
    profs = profiles(cfg, count, rng)
    slow = data_parallel(cfg, profs, faults, checkpoint_seconds=1200.0)
    fast = data_parallel(cfg, profs, faults, checkpoint_seconds=60.0)
    spare = data_parallel(cfg, profs, faults, checkpoint_seconds=60.0, replace_seconds=30.0)
    assert slow.stalls > 0 and slow.lost_tokens > fast.lost_tokens
    assert slow.goodput < fast.goodput < spare.goodput <= 1.0
    total = sum(up_seconds(cfg, count, faults))
    assert 0 < total < cfg.peers * cfg.duration


def test_churn_brings_fresh_peers_that_train_and_get_merged() -> None:
    # k = 7 loses up to 2 members; k = 4 only 1, and under this much churn a committee of 4
    # sometimes seats two volunteers who leave during its round: the run then stalls, as the
    # real protocol would (docs/adr/0021-network-simulator.md).
    cfg = replace(SMALL, peers=24, committee_size=7, duration=3600.0, churn_per_hour=1.0, seed=7)
    result, world = simulate_run(cfg, baseline=False)
    fresh = {p.peer_id for p in world.profiles[cfg.peers :]}
    merged_from = {
        world.subs[d].peer_id for c in world.certs[-3:] for d in c.merged if d in world.subs
    }
    assert fresh and fresh & merged_from
    assert result.goodput > 0.8, result


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="faulty_syncers"):
        SimConfig(faulty_syncers=1.0)
    with pytest.raises(ValueError, match="positive"):
        SimConfig(peers=0)


def test_netsim_command_prints_the_figures_and_refuses_bad_settings_in_one_line() -> None:
    import json

    from typer.testing import CliRunner

    from p2pdiloco.cli.app import app

    out = CliRunner().invoke(
        app, ["netsim", "--peers", "8", "--committee", "4", "--minutes", "10", "--json"]
    )
    assert out.exit_code == 0, out.output
    figures = json.loads(out.output)
    assert figures["versions"] > 0 and 0 < figures["goodput"] <= 1
    bad = CliRunner().invoke(app, ["netsim", "--faulty", "1.5"])
    assert bad.exit_code == 2 and "error: faulty_syncers must be in [0, 1)" in bad.output


def test_members_with_thin_uplinks_drop_late_relays_and_push_back() -> None:
    """Relays queue on a member's uplink (ADR 0034): at 1 MB/s a member cannot pass 4 MB
    deltas to 7 fellows for 48 learners within a round, so copies not begun by the close are
    dropped (the agreed ones are fetched) and learners hear BUSY; rounds still certify."""
    cfg = replace(SMALL, peers=48, committee_size=8, duration=1800.0, up_mbps=8.0, bw_sigma=0.0)
    result, world = simulate_run(cfg, baseline=False)
    assert world.relays.dropped > 0 and world.relays.busy > 0
    assert result.versions >= 5, result  # live: rounds certify (a view may time out)
    assert result.wrong_certificates == 0 and result.conflicts == 0


def test_members_that_restart_mid_round_still_get_the_proposal_and_sign() -> None:
    """Two of version v's four members restart just after v − 1 is certified, so they open v's
    round only once their state is loaded (``restart_seconds``), after the leader proposed. The
    leader sends the proposal again while they answer "later" (``sync.sending``, ADR 0037):
    they merge and sign, and v is certified in its first view. Before, the proposal reached
    only the two members open at the time, short of the quorum of 3, and the view changed."""
    cfg = replace(SMALL, duration=900.0, restart_seconds=60.0)
    _, clean = simulate_run(cfg, baseline=False)
    v = 4
    before, due = clean.certs[v - 2], clean.certs[v - 1]
    assert due.version == v and due.view == 0
    leader = due.committee[0]  # attempt 0 leads
    late = [m for m in due.committee if m != leader][:2]
    index = {p.peer_id: p.index for p in profiles(cfg, cfg.peers, random.Random(cfg.seed))}
    at = before.certified_at + 0.5
    faults = [Fault(at, index[m], kind) for m in late for kind in ("down",)]
    faults += [Fault(at + 1.0, index[m], "up") for m in late]
    result, world = simulate_run(cfg, baseline=False, faults=faults)
    cert = world.certs[v - 1]
    assert cert.version == v and cert.view == 0, cert
    assert set(late) & set(cert.signers), cert.signers
    assert result.view_changes == 0 and result.conflicts == 0


def test_a_committee_that_lost_its_quorum_hands_the_version_on_without_the_view_timeout() -> None:
    """Two of version v's four members (quorum 3) go down as v − 1 is certified and stay down.
    The two left merge and sign, and find the others unreachable when they send their
    signatures: with the quorum out of reach they vote at once (``quorum_unreachable``, ADR
    0041), and view 1, locked on what they signed, certifies v well before view 0's timeout
    (120 s here). Before, they waited the timeout out. Neither leads view 1 (a silent leader
    is ADR 0038's case, not this one)."""
    cfg = replace(SMALL, duration=900.0)
    _, clean = simulate_run(cfg, baseline=False)
    v = 4
    before, due = clean.certs[v - 2], clean.certs[v - 1]
    assert due.version == v and due.view == 0
    _, upto = simulate_run(replace(cfg, duration=before.certified_at + 0.1), baseline=False)
    view1 = committee_for(upto.run_id, upto.manifest, upto.cert, 1).members
    gone = [m for m in due.committee if m not in (due.committee[0], view1[0])][:2]
    assert len(gone) == 2 and len(set(view1) - set(gone)) >= upto.manifest.quorum
    index = {p.peer_id: p.index for p in profiles(cfg, cfg.peers, random.Random(cfg.seed))}
    at = before.certified_at + 0.5
    faults = [Fault(at, index[m], "down") for m in gone]
    faults += [Fault(at + 600.0, index[m], "up") for m in gone]
    result, world = simulate_run(cfg, baseline=False, faults=faults)
    cert = world.certs[v - 1]
    assert cert.version == v and cert.view == 1, cert
    assert cert.certified_at - cert.opened_at < 120.0, cert
    assert result.conflicts == 0 and not cert.wrong


def test_what_a_sender_had_in_flight_is_lost_when_it_crashes() -> None:
    """Proposals, signatures and relayed copies (``World.sent_by``) arrive only if their sender
    is still up, in the same life, when the transfer ends: a crash breaks the connection. The
    real leader that died while proposing reached only some fellows (ADR 0042)."""
    _, world = simulate_run(replace(SMALL, duration=120.0), baseline=False)
    src = next(i for i, p in world.peers.items() if p.up)
    now, got = world.clock.now, []
    world.sent_by(src, now + 1.0, got.append, "before the crash")
    world.sent_by(src, now + 3.0, got.append, "after it")
    world.clock.at(now + 2.0, world._fault, Fault(now + 2.0, src, "down"))
    world.clock.at(now + 2.5, world._fault, Fault(now + 2.5, src, "up"))  # a new life
    lost = world.lost_in_flight
    world.clock.run(now + 4.0)
    assert got == ["before the crash"] and world.lost_in_flight == lost + 1


def test_when_every_member_is_busy_the_one_asked_longest_ago_is_asked_again() -> None:
    # As core.delivery.next_targets: one at a time, round the busy members (ADR 0046).
    retried: list[int] = []
    ids = {i: f"m{i}" for i in (1, 2, 3)}

    class Clock:
        now = 0.0

        def at(self, t: float, fn: Callable[..., None], *args: object) -> None:
            self.now = t  # the retry's time comes at once
            fn(*args)

    class World:  # what SimLearner.reply touches: no fresh member is left to ask
        version = 3
        peers = {0: SimpleNamespace(up=True, epoch=0)} | {
            i: SimpleNamespace(profile=SimpleNamespace(peer_id=m)) for i, m in ids.items()
        }
        by_id = {m: i for i, m in ids.items()}
        clock = Clock()

        def deliver_one(self, _learner: object, _sub: object, member: int) -> None:
            retried.append(member)

    learner = SimLearner(World(), 0, machine=None, epoch=0)  # type: ignore[arg-type]
    sub = Submission("p", "run", 3, 10, 10, "d" * 64)
    machine = Delivery(sub.digest, "p", order=["m1", "m2", "m3"], running=True, passes=3)
    machine.statuses = {"m1": "busy", "m2": "busy"}
    machine.retry, machine.outstanding = ["m1", "m2"], {"m3"}  # m3 asked, not answered yet
    learner.pending = Pending(sub, machine)
    for member in (3, 1, 2, 3):
        learner.reply(sub.digest, member, False, Reason.BUSY, None)
    assert retried == [1, 2, 3, 1]
