"""A discrete-event simulator of a whole run, on the real protocol code.

Every decision is taken by the classes the node runs: the syncer round (``sync.round``), the
learner machine (``sync.learner_machine``), the election (``sync.roster.committee_of_roster``,
``sync.committee``), trust (``sync.trust``), the certified roster (``sync.roster.next_roster``)
and the round parameters from a real signed manifest (``sync.rules.params_of``). What the
simulator models instead of running: time (an event heap), compute (steps per second per peer),
links (bandwidth and latency, serialized per endpoint), failures, churn and faulty syncers,
and the merge (a hash of the input set and weights in metadata mode; the real tensor merge,
``sync.certified.next_state``, in tensor mode). See ``docs/adr/0021-simulator.md``.
"""

from p2pdiloco.sim.config import SimConfig
from p2pdiloco.sim.run import SimResult, simulate_run

__all__ = ["SimConfig", "SimResult", "simulate_run"]
