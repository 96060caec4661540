"""A learner uploads each delta once: to one committee member, which relays it to the others
(``core.delivery``, ``sync.relay``). In process, over the in-memory transport, whose hub
sees every request with its bytes and the answer it got."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from p2pdiloco.core.delivery import intake_order, next_targets
from p2pdiloco.net.sync_rpc import RpcRefused
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.submissions import open_submission
from p2pdiloco.testing.memnet import MemoryNetwork
from tests.test_runtime_memory import check_chains

A, B, C, D = "peerA", "peerB", "peerC", "peerD"


def test_the_order_is_the_learner_itself_then_one_drawn_from_the_digest() -> None:
    members = [A, B, C, D]
    assert intake_order("d1", members, B)[0] == B
    assert sorted(intake_order("d1", members, "outsider")) == sorted(members)
    firsts = Counter(intake_order(f"digest{i}", members, "outsider")[0] for i in range(400))
    assert set(firsts) == set(members) and min(firsts.values()) > 60  # spread over the members


def test_next_targets_moves_on_from_the_unreachable_only() -> None:
    order = [A, B, C]
    assert next_targets(order, {}, []) == [A]
    assert next_targets(order, {A: "error"}, [A]) == [B]  # cannot be reached: the next at once
    assert next_targets(order, {A: "rejected"}, [A]) == [A]  # "later": the same one again
    assert next_targets(order, {A: "rejected"}, []) == []  # refused: the others would too
    assert next_targets(order, {A: "error", B: "rejected"}, [A]) == []
    assert next_targets(order, {A: "rejected", B: "accepted"}, [A]) == []  # held: done
    assert next_targets(order, {A: "error", B: "error", C: "error"}, [A, B, C]) == [A, B, C]
    # A later view's committee: the member that held or refused it left, so a new one is asked
    assert next_targets([C, D], {A: "accepted"}, []) == [C]
    assert next_targets([C, D], {A: "rejected"}, []) == [C]


def test_next_targets_moves_on_from_a_busy_member_and_retries_busy_ones_one_at_a_time() -> None:
    """ADR 0046: BUSY means that member's uplink cannot relay more this round; another
    member's may. Once every member is busy, they are asked again one at a time (the one asked
    longest ago first), so a delta is never uploaded to two members at once."""
    order = [A, B, C]
    assert next_targets(order, {A: "busy"}, [A]) == [B]  # the next member at once
    assert next_targets(order, {A: "busy", B: "busy"}, [A, B]) == [C]
    assert next_targets(order, {A: "busy", B: "busy", C: "busy"}, [B, C, A]) == [B]
    assert next_targets(order, {A: "busy", B: "accepted"}, [A]) == []  # held: done
    assert next_targets(order, {A: "busy", B: "rejected"}, [A]) == []  # refused: done
    assert next_targets(order, {A: "busy", B: "rejected"}, [A, B]) == [C]  # B said "later"


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.slow
def test_each_delta_is_uploaded_by_its_learner_once_and_relayed_to_the_committee(
    tmp_path: Path,
) -> None:
    own: Counter[str] = Counter()  # digest → members that accepted it from its learner
    relayed: Counter[str] = Counter()  # digest → members that accepted a relayed copy

    run_id = ""

    def tap(src: str, dst: str, control: dict[str, Any], frames: list[bytes], reply: Any) -> None:
        if control["op"] != "submit" or reply.get("status") != "accepted":
            return
        sub = open_submission(frames[0], run_id=run_id)
        # The learner's own upload asks for a relay; a relay (even by a learner that is on
        # the committee, of its own delta) does not.
        (own if control.get("relay") is True else relayed)[sub.digest] += 1
        assert control.get("relay") is not True or sub.header.peer_id == src

    async def main() -> None:
        nonlocal run_id
        # Six learners, committees of four: a learner off the committee uploads to one member.
        async with MemoryNetwork(tmp_path, nodes=6, committee_size=4) as net:
            run_id, net.hub.tap = net.run_id, tap
            await net.wait_for(lambda: net.min_version() >= 2, 120, "version 2 everywhere")
            check_chains(net)

    asyncio.run(main())
    assert own and relayed, (own, relayed)
    assert max(own.values()) == 1, own  # never held twice from its learner's own upload
    # What was relayed reached the other members: up to three copies of each.
    assert max(relayed.values()) <= 3 and sum(relayed.values()) >= len(own)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.slow
def test_a_delta_refused_busy_goes_to_the_next_member_at_once(tmp_path: Path) -> None:
    """ADR 0046: the first member each delta is uploaded to answers BUSY (its uplink full).
    Each such delta is then taken by another member of the same committee, uploaded by its
    learner once, and versions certify; before, the learner asked the busy member again."""
    refused_by: dict[str, str] = {}  # digest → the member that answered BUSY
    taken_by: dict[str, str] = {}  # digest → the member that took it from its learner
    own: Counter[str] = Counter()
    run_id = ""

    def tap(src: str, dst: str, control: dict[str, Any], frames: list[bytes], reply: Any) -> None:
        mine = control["op"] == "submit" and control.get("relay") is True
        if mine and reply.get("status") == "accepted":
            digest = open_submission(frames[0], run_id=run_id).digest
            own[digest] += 1
            taken_by[digest] = dst

    async def main() -> None:
        nonlocal run_id
        async with MemoryNetwork(tmp_path, nodes=6, committee_size=4) as net:
            run_id, net.hub.tap = net.run_id, tap
            for node in net.nodes:
                member = node.peer_id
                handler, limits, screen = net.hub.handlers[member]

                async def first_busy(
                    op: str,
                    src: str,
                    control: dict[str, Any],
                    frames: list[bytes],
                    member: str = member,
                    handler: Any = handler,
                ) -> Any:
                    if op == "submit" and control.get("relay") is True and src != member:
                        digest = open_submission(frames[0], run_id=run_id).digest
                        if refused_by.setdefault(digest, member) == member:
                            raise RpcRefused(Reason.BUSY, "relay queue full (test)")
                    return await handler(op, src, control, frames)

                net.hub.handlers[member] = (first_busy, limits, screen)
            await net.wait_for(lambda: net.min_version() >= 3, 180, "version 3 everywhere")
            check_chains(net)

    asyncio.run(main())
    taken = set(refused_by) & set(taken_by)
    assert taken, (refused_by, taken_by)  # learners off the committee upload to a member
    assert all(taken_by[d] != refused_by[d] for d in taken), (refused_by, taken_by)
    assert max(own.values()) == 1, own  # still one upload per delta
