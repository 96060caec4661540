"""What every simulated party reads of the network (``sim.world.World`` is it): the run's
config and clock, the peers, the certified version and its committee, the submissions seen and
the merge. The learner's and the member's protocols extend it with what each alone needs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from p2pdiloco.core.roster import CommitteeInfo
from p2pdiloco.core.round import Submission
from p2pdiloco.sim.backend import Merge
from p2pdiloco.sim.clock import Clock
from p2pdiloco.sim.config import PeerState, SimConfig


class SimNetwork(Protocol):
    cfg: SimConfig
    clock: Clock

    @property
    def peers(self) -> Mapping[int, PeerState]: ...
    @property
    def by_id(self) -> Mapping[str, int]: ...
    @property
    def version(self) -> int: ...
    @property
    def committee(self) -> CommitteeInfo: ...
    @property
    def subs(self) -> dict[str, Submission]: ...
    @property
    def merge(self) -> Merge: ...
