"""The pure parts of bench/chaos.py: the kill schedule, the log timeline and the verdicts on
state directories written by the node's own ``ChainStore`` and then tampered with."""

from __future__ import annotations

import hashlib
import json
from itertools import pairwise
from pathlib import Path

import torch

from bench.chaos_verify import (
    BOOTSTRAP,
    StateReport,
    certified_times,
    credited_tokens,
    gaps,
    lost_versions,
    make_schedule,
    most_out_at_once,
    verify_state_dir,
)
from p2pdiloco.core.roster import committee_for, next_roster, roster_of, with_roster
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.certificates import (
    Accepted,
    Certificate,
    CertificateBody,
    assemble,
    parse_certificate,
    roster_digest,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.runtime.chain import ChainStore
from p2pdiloco.sync.certified import CertifiedState
from p2pdiloco.train.outer import MOMENTUM_PREFIX

KEYS = [Identity.from_seed(hashlib.sha256(b"chaos%d" % i).digest()) for i in range(4)]
BY_ID = {k.peer_id: k for k in KEYS}
RUN_ID, MANIFEST, _ = create_manifest(
    KEYS[0],
    name="chaos",
    model="gemma-tiny",
    data="embedded",
    seed=0,
    inner_steps=10,
    committee_size=4,
    genesis_committee=[k.peer_id for k in KEYS],
    rules={"grace": 15.0, "agree_timeout": 5.0, "view_timeout": 30.0},
)
NODES = [f"node{i}" for i in range(6)]


def test_schedule_is_seeded_restarts_every_kill_and_keeps_one_node_down_at_a_time() -> None:
    events = make_schedule(7, 240.0, NODES)
    assert events == make_schedule(7, 240.0, NODES) != make_schedule(8, 240.0, NODES)
    assert [e.t for e in events] == sorted(e.t for e in events)
    assert sum(e.target == BOOTSTRAP and e.action == "kill" for e in events) == 1
    down: dict[str, float] = {}
    for e in events:
        assert 0 < e.t < 240.0
        if e.action == "kill":
            assert e.target not in down  # only a live process is killed
            nodes_down = [n for n in down if n != BOOTSTRAP]
            assert e.target == BOOTSTRAP or not nodes_down
            down[e.target] = e.t
        else:
            assert 5.0 <= e.t - down.pop(e.target) <= 15.0
    assert not down  # everything is up again at the end
    kills = [e.t for e in events if e.action == "kill" and e.target != BOOTSTRAP]
    assert len(kills) >= 5 and all(19.99 <= b - a <= 40.01 for a, b in pairwise(kills))
    assert make_schedule(7, 240.0, NODES, bootstrap=False) == [
        e for e in events if e.target != BOOTSTRAP
    ]


def test_certified_times_take_the_earliest_line_and_gaps_cover_the_window() -> None:
    logs = [
        "2026-11-24 10:00:05,000 INFO p2pdiloco.sync.service: version 3 certified by 3/4 syncers\n"
        "2026-11-24 10:00:06,500 INFO p2pdiloco.runtime: applied version 3 (committee a, b)\n"
        "2026-11-24 10:01:00,000 INFO p2pdiloco.join: [training] | version 3 | step 1/12\n",
        "2026-11-24 10:00:04,250 INFO p2pdiloco.runtime: applied version 2 (committee a, b)\n"
        "2026-11-24 10:00:20,000 INFO p2pdiloco.runtime: applied version 4 (committee c)\n",
    ]
    times = certified_times(logs)
    assert sorted(times) == [2, 3, 4]
    assert times[3] - times[2] == 0.75 and times[4] - times[3] == 15.0
    start = times[2] + 0.25
    found = gaps(times, start, start + 40.0)
    assert [(g.after, g.before, g.seconds) for g in found] == [
        (2, 3, 0.5),
        (3, 4, 15.0),
        (4, None, 24.5),  # open: nothing certified between version 4 and the end
    ]


def _state(version: int) -> CertifiedState:
    w = torch.arange(6, dtype=torch.float32) * version
    return CertifiedState.from_tensors(
        version, None, {"w": w, MOMENTUM_PREFIX + "w": torch.zeros(6)}
    )


def _chain(versions: int, tokens: int = 100) -> list[tuple[Certificate, CertifiedState]]:
    out: list[tuple[Certificate, CertifiedState]] = []
    prev: Certificate | None = None
    for v in range(1, versions + 1):
        info = committee_for(RUN_ID, MANIFEST, prev)
        accepted = [
            Accepted(
                peer_id=k.peer_id,
                digest=hashlib.sha256(b"%d%d" % (v, i)).hexdigest(),
                steps=10,
                tokens=tokens,
            )
            for i, k in enumerate(KEYS)
        ]
        accepted.sort(key=lambda a: a.digest)
        state = _state(v)
        body = CertificateBody(
            run=RUN_ID,
            version=v,
            base_version=v - 1,
            state_hash=state.state_hash,
            committee=list(info.members),
            quorum=info.quorum,
            accepted=accepted,
            roster_hash=roster_digest(
                next_roster(roster_of(MANIFEST, prev), new_version=v, accepted=accepted)
            ),
        )
        sigs = {p: sign_body(BY_ID[p], body) for p in body.committee}
        prev = with_roster(MANIFEST, prev, parse_certificate(assemble(body, sigs), run_id=RUN_ID))
        state.cert = prev
        out.append((prev, state))
    return out


def _persisted(tmp_path: Path, versions: int = 3) -> Path:
    store = ChainStore(tmp_path, RUN_ID)  # the node's own writer
    chain = _chain(versions)
    for i, (_, state) in enumerate(chain):
        store.persist([c for c, _ in chain[: i + 1]], state)
    return tmp_path


def test_a_state_directory_written_by_the_node_verifies(tmp_path: Path) -> None:
    rep = verify_state_dir(_persisted(tmp_path), RUN_ID, MANIFEST)
    assert rep.problems == []
    assert rep.chain_end == 3 and rep.checkpoints == [2, 3] and rep.resumes_from == 3
    assert credited_tokens([rep], after=1, upto=3) == 2 * 4 * 100


def test_a_flipped_byte_in_the_newest_checkpoint_is_a_corrupt_state(tmp_path: Path) -> None:
    d = _persisted(tmp_path)
    ckpt = d / "certified" / "ckpt-00000003.safetensors"
    raw = bytearray(ckpt.read_bytes())
    raw[-3] ^= 0x40  # inside the tensor data
    ckpt.write_bytes(bytes(raw))
    rep = verify_state_dir(d, RUN_ID, MANIFEST)
    assert rep.checkpoints == [2] and rep.resumes_from == 2
    assert any("ckpt-00000003" in p for p in rep.problems), rep.problems
    assert any("LATEST names version 3" in p for p in rep.problems), rep.problems


def test_a_checkpoint_whose_tensors_differ_from_its_certificate_is_corrupt(tmp_path: Path) -> None:
    d = _persisted(tmp_path)
    chain = _chain(3)
    wrong = _state(7)
    wrong.cert = chain[2][0]  # version 3's certificate beside other tensors, hashed correctly
    ChainStore(d, RUN_ID).store.save(
        wrong.tensors(), {"version": 3, "run_id": RUN_ID, "cert": chain[2][0].raw.decode()}
    )
    rep = verify_state_dir(d, RUN_ID, MANIFEST)
    assert any("do not hash to the certificate" in p for p in rep.problems), rep.problems


def test_a_forged_or_missing_certificate_is_corrupt(tmp_path: Path) -> None:
    d = _persisted(tmp_path)
    path = d / "certs" / "00000002.json"
    obj = json.loads(path.read_bytes())
    obj["body"]["accepted"][0]["tokens"] = 10**9  # every signature breaks
    path.write_text(json.dumps(obj))
    rep = verify_state_dir(d, RUN_ID, MANIFEST)
    assert rep.chain_end == 1 and any("00000002.json" in p for p in rep.problems)
    path.unlink()
    rep = verify_state_dir(d, RUN_ID, MANIFEST)
    assert rep.chain_end == 1 and any("no certificate for version 2" in p for p in rep.problems)


def test_lost_versions_forks_and_forgotten_versions() -> None:
    a = StateReport(chain_end=3, contents={1: "x", 2: "y", 3: "z"})
    b = StateReport(chain_end=2, contents={1: "x", 2: "OTHER"})
    found = lost_versions({"node0": a, "node1": b}, [1, 2, 3, 4], {"node0": 3, "node1": 3})
    assert found == {"lost": [2, 3, 4], "forks": [2], "forgotten": [["node1", 2, 3]]}
    clean = lost_versions({"node0": a, "node1": a}, [1, 2, 3], {"node0": 3, "node1": 3})
    assert clean == {"lost": [], "forks": [], "forgotten": []}


def test_most_nodes_out_at_once_counts_overlaps_inside_the_window() -> None:
    out = {"node0": [(10.0, 30.0)], "node1": [(25.0, 40.0), (60.0, 70.0)], "node2": [(0.0, 5.0)]}
    assert most_out_at_once(out, 20.0, 50.0) == 2
    assert most_out_at_once(out, 31.0, 59.0) == 1
    assert most_out_at_once(out, 41.0, 59.0) == 0
    assert most_out_at_once(out, 30.0, 65.0) == 1  # one ends as the other starts: not both
