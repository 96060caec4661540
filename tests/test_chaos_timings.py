"""``bench/chaos_timings.py`` reads what a round costs from chaos logs, for the prediction."""

from __future__ import annotations

from bench.chaos_timings import timings

LEADER = """\
2026-11-27 09:45:14,800 INFO p2pdiloco.sync.service: proposing 4 submissions for version 31 (attempt 0)
2026-11-27 09:45:15,600 INFO p2pdiloco.sync.service: merged version 31: 4 accepted, 0 screened out (median), state 1bab3bf29b14
2026-11-27 09:45:15,700 INFO p2pdiloco.sync.service: version 31 certified by 3/4 syncers (view 2)
2026-11-27 09:45:16,700 INFO p2pdiloco.runtime: applied version 31 (committee a, b, c, d; 4 deltas merged)
Traceback (most recent call last): a line without a time stamp is skipped
"""
OTHER = """\
2026-11-27 09:45:15,500 INFO p2pdiloco.sync.service: version 31 certified by 3/4 syncers (view 2)
2026-11-27 09:45:17,500 INFO p2pdiloco.runtime: applied version 31 (committee a, b, c, d; 4 deltas merged)
2026-11-27 09:45:18,000 INFO p2pdiloco.sync.service: proposing 5 submissions for version 32 (attempt 0)
"""


def test_merge_time_per_input_and_apply_time_are_medians_over_the_logs() -> None:
    t = timings([LEADER, OTHER])
    assert t["merges"] == 1 and t["merge_s_per_input"] == 0.2  # 0.8 s for 4 inputs
    # certified first at 15.5 (any node), applied at 16.7 and 17.5: median 1.6 s
    assert t["applies"] == 2 and t["apply_s"] == 1.6
    assert timings([]) == {"merge_s_per_input": None, "merges": 0, "apply_s": None, "applies": 0}
