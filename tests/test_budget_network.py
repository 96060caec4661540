"""Rounds that fit mixed hardware (issue 10 item 4) on real processes: four ``join`` processes
under a manifest time budget, three training half the time and one a sixth of the time
(``--compute-share``: a budget counts wall time, pauses included, so the last is paced like
hardware three times slower than the others). It still contributes to most rounds, with fewer
tokens in all, each of its deltas weighed by the tokens it really trained.

The in-process twin with more rounds is tests/test_runtime_budget.py; this one checks the same
guarantees through the CLI, the real transport and the real pacing.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from p2pdiloco.harness.demo import LocalNetwork
from p2pdiloco.protocol.identity import Identity
from tests.test_runtime_budget import check_slow_learner
from tests.test_sync_network import SMALL, certificates

pytestmark = [pytest.mark.slow, pytest.mark.solo, pytest.mark.timeout(600)]

BUDGET = 3.0  # seconds of wall time per delta
CAP = 0.5  # not binding for four learners of which one is slow (the default 0.25 would be)
LINGER = 2.0  # stragglers' wait once three of four are in: a slow learner's last step
UNTIL = 6


def test_a_node_three_times_slower_than_the_others_contributes_to_most_rounds_by_its_tokens(
    tmp_path: Path,
) -> None:
    small = replace(SMALL, compute_share=0.5)  # see the docstring
    with LocalNetwork(tmp_path, small, kill_on_exit=True) as net:
        net.start_bootstrap()
        keys = [Identity.generate() for _ in range(4)]  # k = 4: all genesis, all trusted
        run_id = net.publish_run(
            keys, inner_steps=10_000, time_budget=BUDGET, weight_cap=CAP, linger=LINGER
        )  # the budget, never H, ends a stretch
        nodes = [
            net.start_node(
                f"node{i}",
                k,
                until_version=UNTIL + 1,
                extra=["--compute-share", "0.167"] if i == 3 else (),
            )
            for i, k in enumerate(keys)
        ]
        net.wait_versions(UNTIL, nodes, 400)
        certs = [c for c in certificates(nodes[0], run_id) if 2 <= c.body.version <= UNTIL]
        slow_log = nodes[3].text()

    assert "Traceback" not in slow_log
    slow = keys[3].peer_id
    totals = check_slow_learner(certs, slow, CAP)  # most rounds, fewer tokens, weighed by them
    per_delta = {
        who: statistics.median(
            a.tokens for c in certs for a in c.body.accepted if (a.peer_id == slow) == who
        )
        for who in (True, False)
    }
    print(f"tokens: {totals}; per delta (slow, others): {per_delta}")
    assert per_delta[True] < 0.6 * per_delta[False]  # a budget's worth of its slower steps
