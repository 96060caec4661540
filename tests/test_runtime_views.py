"""View change in whole runtimes (in memory, real signatures and tensors): a committee that
loses its quorum hands the version to the next view's committee, and learners keep training.

Asserted: the guarantees (every chain verifies from genesis, certificates of later views carry
the proof that earlier views timed out, no syncer signs two states in one view, learners'
token counters keep moving), never one schedule's timing.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from p2pdiloco.core.learner import LearnerPhase
from p2pdiloco.core.roster import committee_for, roster_of
from p2pdiloco.protocol.certificates import parse_certificate
from p2pdiloco.sync.committee_msgs import open_proposal
from p2pdiloco.testing.memnet import MemoryNetwork
from tests.test_runtime_memory import check_chains, run

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow, pytest.mark.solo]

VIEW_TIMEOUT = 10.0
# What a learner's view says while it trains: the LearnerPhase values but IDLE.
TRAINING_PHASES = {p.value for p in LearnerPhase if p is not LearnerPhase.IDLE}
RULES = {"grace": 4.0, "agree_timeout": 2.0, "view_timeout": VIEW_TIMEOUT}


@pytest.fixture
def busy_neighbours() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two processes that spin on a core each beside the test: an overloaded machine (issue
    39), where a round takes longer than one fixed timeout."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def signed_per_view(net: MemoryNetwork) -> dict[tuple[str, int, int], set[str]]:
    """(syncer, version, view) → state hashes it signed, from every certificate any node holds."""
    out: dict[tuple[str, int, int], set[str]] = {}
    for node in net.live():
        for raw in node.runtime.chain.certs.values():
            cert = parse_certificate(raw, run_id=net.run_id)
            for s in cert.signers:
                key = (s, cert.body.version, cert.body.view)
                out.setdefault(key, set()).add(cert.body.state_hash)
    return out


@pytest.mark.parametrize(
    ("dead", "rules", "bound"),
    [
        # The leader and the next member: the leader is silent, or the view times out.
        (slice(0, 2), RULES, 6 * VIEW_TIMEOUT + 30),
        # Two members but not the leader, with a view timeout the test never waits for: the
        # two left sign, find the others unreachable, and vote at once (ADR 0041).
        (slice(1, 3), {**RULES, "view_timeout": 3600.0}, 120.0),
    ],
    ids=["leader-and-next", "quorum-out-of-reach"],
)
def test_two_dead_syncers_of_four_hand_the_version_to_the_next_view(
    tmp_path: Path, dead: slice, rules: dict[str, float], bound: float
) -> None:
    two_dead_of_four(tmp_path, dead, rules, bound)


def test_quorum_out_of_reach_with_two_busy_processes_beside_it(
    tmp_path: Path, busy_neighbours: list[subprocess.Popen[bytes]]
) -> None:
    """The case issue 39 found flaky with one other process beside the suite: a round slower
    than the fixed agree timeout made every view end and the next start over. The pacemaker
    doubles the timeouts after each failed view (ADR 0055), so a later view has time."""
    assert all(p.poll() is None for p in busy_neighbours)
    # The setup (all six learners merged once, on a busy machine where a slow learner's delta
    # is late for a few rounds) gets longer; the view change keeps its bound of 120 s.
    two_dead_of_four(tmp_path, slice(1, 3), {**RULES, "view_timeout": 3600.0}, 120.0, setup=400)
    assert all(p.poll() is None for p in busy_neighbours)  # they spun throughout


def describe(net: MemoryNetwork) -> str:
    """What each live node is waiting for (a failed wait says it): its version, view, seat,
    lock and round, and which learners the certified roster lacks."""
    assert net.manifest is not None
    lines = []
    for n in net.live():
        svc = n.runtime.service
        node = svc.node if svc is not None else None
        views = node.views if node is not None else None
        rnd = node.round if node is not None else None
        seat = "member" if views is not None and views.member() else "off"
        lock = views.lock[:8] if views is not None and views.lock else None
        state = "no round"
        if rnd is not None:
            gone = sorted(p[-6:] for p in rnd.reach.gone)
            state = (
                f"round {rnd.phase.value}, attempt {rnd.attempt}, abandoned {rnd.abandoned}, "
                f"{len(rnd.accepted)} inputs, signatures from {len(rnd.signatures)}, "
                f"unreachable {gone}"
            )
        view = views.view if views is not None else None
        lines.append(
            f"  {n.name} ({n.peer_id[-6:]}): v{n.version} view {view} {seat}, lock {lock}, {state}"
        )
    cert = net.live()[0].runtime.chain.cert
    roster = {e.peer_id for e in roster_of(net.manifest, cert)}
    missing = [f"{n.name} ({n.peer_id[-6:]})" for n in net.nodes if n.peer_id not in roster]
    return "\n".join([*lines, f"  not in the certified roster: {missing}"])


async def wait(net: MemoryNetwork, pred: Callable[[], bool], timeout: float, what: str) -> None:
    """``net.wait_for``, whose failure also says what each node was waiting for."""
    try:
        await net.wait_for(pred, timeout, what)
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{describe(net)}") from e


def two_dead_of_four(
    tmp_path: Path, dead: slice, rules: dict[str, float], bound: float, setup: float = 120
) -> None:
    async def main() -> None:
        async with MemoryNetwork(tmp_path, nodes=6, committee_size=4, rules=rules) as net:
            assert net.manifest is not None
            await wait(net, lambda: net.min_version() >= 2, 120, "version 2 everywhere")
            # Later views can seat only peers the certified roster knows (a delta merged).
            # With just k of them, two dead among those k leave no live quorum to hand the
            # version to, by design (2 of 4 is more than k/3): wait until all six are known.
            everyone = {n.peer_id for n in net.live()}

            def all_in_roster() -> bool:
                cert = net.live()[0].runtime.chain.cert
                return everyone <= {e.peer_id for e in roster_of(net.manifest, cert)}

            await wait(net, all_in_roster, setup, "every learner in the certified roster")
            base = max(n.version for n in net.live())
            await wait(net, lambda: net.min_version() >= base, 60, "all on one version")
            info = committee_for(net.run_id, net.manifest, net.live()[0].runtime.chain.cert)
            assert len(roster_of(net.manifest, net.live()[0].runtime.chain.cert)) >= 6
            victims = [n for n in net.live() if n.peer_id in info.members[dead]]
            for n in victims:
                await net.stop(n)
            survivors = net.live()
            holder = survivors[0].runtime.chain
            trainers = {n.name: n.trainer for n in survivors if n.trainer is not None}
            tokens_before = {k: t.view.tokens_trained for k, t in trainers.items()}
            phases: dict[str, set[str]] = {k: set() for k in trainers}

            def next_version() -> bool:  # and what phase each learner is in meanwhile
                for k, t in trainers.items():
                    phases[k].add(t.view.phase)
                return net.min_version() >= base + 1

            # View 0 cannot reach its quorum of 3: view 1 (or, if the draw seats both dead
            # members again, a later view) certifies it.
            await wait(net, next_version, bound, "next version")
            hashes = check_chains(net)  # every certificate verifies from genesis, views included
            cert = parse_certificate(holder.certs[base + 1], run_id=net.run_id)
            # a later view's certificate carries the TC of the view before it (ADR 0055)
            assert cert.body.view >= 1 and [tc.view for tc in cert.views] == [cert.body.view - 1]
            assert hashes[base + 1] == cert.body.state_hash
            assert all(len(h) == 1 for h in signed_per_view(net).values())
            # Learners kept training while the committee failed over: none was ever idle (the
            # one phase of a learner that does not train) nor failed. How many steps fit in the
            # failover is the schedule's (a view change under load can take less than one
            # step and its pause), so the counters are compared once the run went on.
            assert all(p <= TRAINING_PHASES for p in phases.values()), phases
            await wait(net, lambda: net.min_version() >= base + 2, 90, "one more version")
            tokens_after = {k: t.view.tokens_trained for k, t in trainers.items()}
            assert all(tokens_after[k] > tokens_before[k] for k in trainers), (
                tokens_before,
                tokens_after,
            )
            check_chains(net)

    run(main())


def test_a_healthy_committee_never_changes_view(tmp_path: Path) -> None:
    async def main() -> None:
        async with MemoryNetwork(tmp_path, nodes=4, rules=RULES) as net:
            await net.wait_for(lambda: net.min_version() >= 3, 120, "version 3 everywhere")
            check_chains(net)
            for raw in net.nodes[0].runtime.chain.certs.values():
                assert parse_certificate(raw, run_id=net.run_id).body.view == 0
            # Compute utilization (share of wall time in inner steps) is measured and reported.
            assert all(n.trainer and 0 < n.trainer.view.utilization <= 1 for n in net.nodes)

    run(main())


def test_a_syncer_that_restarts_mid_round_does_not_freeze_a_two_node_run(tmp_path: Path) -> None:
    """The reported rejoin: k = 2, q = 2; one node stops, the other is left alone on the
    committee, then the first comes back from its state directory. Its late round must not
    leave the two signing different states for good: the run certifies on."""

    async def main() -> None:
        async with MemoryNetwork(tmp_path, nodes=2, rules=RULES) as net:
            await net.wait_for(lambda: net.min_version() >= 2, 90, "version 2 on both")
            gone = net.nodes[1]
            await net.stop(gone)
            alone = net.nodes[0]
            start = alone.version
            svc = alone.runtime.service
            assert svc is not None
            # The absence outlasts a view: the lone member gives up on it (votes) first.
            await net.wait_for(
                lambda: bool(svc.views.state and svc.views.state.voted), 2 * VIEW_TIMEOUT + 30
            )
            back = await net.restart(gone)
            await net.wait_for(
                lambda: net.min_version() >= start + 2,
                6 * VIEW_TIMEOUT + 60,
                "two more versions on both",
            )
            check_chains(net)
            assert all(len(h) == 1 for h in signed_per_view(net).values())
            assert back.version >= start + 2

    run(main())


def test_a_volunteer_leaving_a_run_of_two_does_not_stop_it(tmp_path: Path) -> None:
    """k = 3, the creator the one founder, one volunteer: a committee of two would need both
    votes to certify or to end a view, so the volunteer leaving would stop the run for good
    (ADR 0072's stall). Such a committee is the founder alone (ADR 0073): the run certifies on
    without a view change."""

    async def main() -> None:
        async with MemoryNetwork(
            tmp_path, nodes=2, committee_size=3, founders=0, rules=RULES
        ) as net:
            await net.wait_for(lambda: net.min_version() >= 2, 90, "version 2 on both")
            founder, volunteer = net.nodes
            await net.stop(volunteer)
            start = founder.version
            await net.wait_for(
                lambda: founder.version >= start + 2, 2 * VIEW_TIMEOUT + 60, "two more versions"
            )
            check_chains(net)
            for raw in founder.runtime.chain.certs.values():
                body = parse_certificate(raw, run_id=net.run_id).body
                assert body.committee == [founder.peer_id] and body.quorum == 1, body.version
                assert body.view == 0, body.version
            # the volunteer's deltas were merged while it trained: it is on the roster, and
            # still not seated
            roster = roster_of(net.manifest, founder.runtime.chain.cert)
            assert volunteer.peer_id in {e.peer_id for e in roster}

    run(main())


def test_a_proposal_that_reached_one_fellow_is_passed_on_and_no_view_changes(
    tmp_path: Path,
) -> None:
    """Every leader's own proposal reaches one fellow only, as when a leader dies in the
    second it proposes (a chaos run lost 42 s to one). The fellow that adopts it passes it on,
    signed by the leader, to the others (ADR 0042): every version is certified in view 0,
    where before the two fellows left out waited for a leader that was silent to them."""

    async def main() -> None:
        async with MemoryNetwork(tmp_path, nodes=4, rules=RULES) as net:
            lost: list[str] = []

            def lose(src: str, dst: str, op: str, frames: Sequence[bytes]) -> bool:
                if op != "propose" or open_proposal(bytes(frames[0]), net.run_id).signer != src:
                    return False  # only the leader's own sends: copies passed on go through
                reaches = min(n.peer_id for n in net.nodes if n.peer_id != src)
                if dst != reaches:
                    lost.append(dst)
                return dst != reaches

            net.hub.lose = lose
            await net.wait_for(lambda: net.min_version() >= 3, 120, "version 3 everywhere")
            check_chains(net)
            assert lost  # the rule was in force
            for raw in net.nodes[0].runtime.chain.certs.values():
                assert parse_certificate(raw, run_id=net.run_id).body.view == 0

    run(main())
