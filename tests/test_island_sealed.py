"""An island admits only its own (issue 44 item 5): its store is sealed with the island's
secret, so a process that reaches the port without the secret cannot register, beat for a
member, post a command or take a rank; real TCPStores on loopback, a real gloo group."""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from p2pdiloco.island import channel
from p2pdiloco.island.leader import Island
from p2pdiloco.island.sealed import IslandAuthError, SealedStore
from p2pdiloco.island.secret import new_secret, parse_secret
from p2pdiloco.island.spec import IslandSpec
from p2pdiloco.train.configs import InnerConfig

pytestmark = [pytest.mark.timeout(120)]


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip


def test_a_sealed_value_round_trips_and_a_forged_or_foreign_one_is_refused() -> None:
    secret = new_secret()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ours, theirs = SealedStore(master, secret), SealedStore(client(master.port), new_secret())
    ours.set("gen/0", b"plan")
    assert ours.get("gen/0") == b"plan"
    with pytest.raises(IslandAuthError, match="'gen/0' is not sealed"):
        theirs.get("gen/0")  # another secret
    client(master.port).set("g0/cmd/0", b"stop")  # a raw write by anyone who reaches the port
    with pytest.raises(IslandAuthError, match="'g0/cmd/0'"):
        ours.get("g0/cmd/0")
    ours.set("a", b"x")
    master.set("b", master.get("a"))  # a sealed value replayed under another key
    with pytest.raises(IslandAuthError):
        ours.get("b")
    assert parse_secret(secret.hex()) == secret
    with pytest.raises(ValueError, match="64 hex digits"):
        parse_secret("abc")


def _rank1(port: int, secret: bytes, out: mp.Queue) -> None:  # type: ignore[type-arg]
    sealed = SealedStore(client(port), secret)
    dist.init_process_group("gloo", store=channel.pg_store(sealed, 0), rank=1, world_size=2)
    t = torch.ones(2)
    dist.all_reduce(t)
    out.put(t.tolist())
    dist.destroy_process_group()


def test_a_gloo_group_forms_through_the_sealed_store() -> None:
    secret = new_secret()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    sealed = SealedStore(master, secret)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_rank1, args=(master.port, secret, out))
    p.start()
    try:
        dist.init_process_group("gloo", store=channel.pg_store(sealed, 0), rank=0, world_size=2)
        t = torch.ones(2) * 2
        dist.all_reduce(t)
        dist.destroy_process_group()
        assert t.tolist() == [3.0, 3.0] and out.get(timeout=60) == [3.0, 3.0]
    finally:
        p.join(30)


def test_rank_0_admits_sealed_registrations_only_and_logs_a_refusal_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = IslandSpec(("cpu",), lan=True, host="127.0.0.1", secret=new_secret())
    island = Island(spec, "gemma-tiny", 0, InnerConfig(batch_size=4), log_dir=tmp_path)
    port = island.raw_store.port
    # An uninvited process bumps the id counter, registers without the secret (its own id
    # and a replay of a sealed value under another key), and beats for itself.
    intruder = client(port)
    bad = int(intruder.add(channel.MEMBERS, 1_000))
    intruder.queue_push(channel.JOIN, str(bad).encode())
    ours = SealedStore(client(port), spec.secret or b"")
    ours.set("elsewhere", b"7")
    intruder.queue_push(channel.JOIN, intruder.get("elsewhere"))
    # A member of the LAN with the secret registers as run_member does, and beats.
    good = ours.add(channel.MEMBERS, 1)
    ours.push(channel.JOIN, str(good).encode())
    with caplog.at_level(logging.WARNING, logger="p2pdiloco.island.leader"):
        assert island.admit() == [good] and island.admit() == [good]
    refusals = [r.getMessage() for r in caplog.records if "refused a member" in r.getMessage()]
    assert len(refusals) == 1 and "island_auth_failed" in refusals[0]
    assert island.refused == 2 and island.newcomers()
    for n in (1, 2):
        intruder.set(channel.beat_key(bad), str(n))  # an unsealed beat never counts
        ours.set(channel.beat_key(good), str(n))
    assert island._beat(bad) == -1 and island._beat(good) == 2
    intruder.set(channel.beat_key(good), b"999")  # nor does a spoiled one
    assert island._beat(good) == -1
    island.close()
