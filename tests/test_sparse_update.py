"""Certified updates of the parameters' change with the committee's error feedback (ADR 0064).

The committee sends what the parameters changed by, encoded with the run's update codec (the
sparse topk2 included), and keeps what it did not send as a residual beside the outer momentum.
A follower adds the decoded update to its parameters and checks the certificate's
``params_hash``: it never needs the momentum or the residual. A node elected to a committee
downloads them (the committee state) and merges exactly as a member that was there all along.

Real gemma-tiny tensors and real committee signatures, in process; the last test runs whole
nodes over the in-memory transport (``testing/memnet.py``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pdiloco.compress import CODECS
from p2pdiloco.compress.sparse import TopKCodec
from p2pdiloco.core.roster import committee_for, with_roster
from p2pdiloco.harness.simulate import merge_fragment
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.net.sync_rpc import RpcRefused
from p2pdiloco.net.transport import MemoryHub
from p2pdiloco.protocol.certificates import (
    Certificate,
    CertificateBody,
    assemble,
    parse_certificate,
    sign_body,
)
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.reasons import Reason
from p2pdiloco.protocol.records import RunManifest, SyncRules, run_id_of
from p2pdiloco.runtime.chain import ChainStore
from p2pdiloco.sync.aggregator import MergeInput
from p2pdiloco.sync.certified import (
    CertifiedState,
    apply_update,
    certified_params_hash,
    genesis_state,
    next_state,
)
from p2pdiloco.sync.committee_msgs import body_of, request_limits
from p2pdiloco.sync.fetch import download_state, follow_updates
from p2pdiloco.sync.rules import UnsupportedManifest, check_supported
from p2pdiloco.sync.update import UpdateError, rules_codec
from p2pdiloco.train.configs import OuterConfig

KEYS = [Identity.from_seed(hashlib.sha256(b"sparse%d" % i).digest()) for i in range(4)]
BY_ID = {k.peer_id: k for k in KEYS}
OUTER = OuterConfig(lr=0.7, momentum=0.9)


def make_run(codec: str = "topk2", form: str = "params", **rules: Any) -> tuple[str, RunManifest]:
    run_id, manifest, _ = create_manifest(
        KEYS[0],
        name="sparse",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=4,
        committee_size=4,
        compression="topk2",
        genesis_committee=[k.peer_id for k in KEYS],
        rules={"aggregation": "mean", "update_codec": codec, "update_form": form, **rules},
    )
    return run_id, manifest


SHAPES = {"block.0.w": (64, 130), "block.0.b": (100,), "embed": (4096,)}  # chunks and tails


def small_genesis(manifest: RunManifest) -> CertifiedState:
    """A genesis state of a few small tensors (full topk2 chunks and tails), built as
    ``genesis_state`` builds the model's: momentum, and for "params" updates the residual, zero."""
    g = torch.Generator().manual_seed(1)
    params = {n: 0.02 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
    zeros = {n: torch.zeros(s) for n, s in SHAPES.items()}
    feedback = manifest.rules.update_form == "params"
    return CertifiedState(0, None, params, dict(zeros), residual=dict(zeros) if feedback else {})


def round_inputs(base: CertifiedState, seed: int = 0, m: int = 3) -> list[MergeInput]:
    g = torch.Generator().manual_seed(seed)
    return [
        MergeInput(
            f"{seed:02x}{i:02x}" * 16,
            KEYS[i].peer_id,
            {n: 1e-3 * torch.randn(t.shape, generator=g) for n, t in base.params.items()},
            1.0,
        )
        for i in range(m)
    ]


def certify(
    run_id: str,
    manifest: RunManifest,
    base: CertifiedState,
    state: CertifiedState,
    inputs: list[MergeInput],
    *,
    params_hash: str | None = None,
) -> Certificate:
    """The committee's certificate of ``state`` on ``base``, signed by all four members."""
    committee = committee_for(run_id, manifest, base.cert)
    body = body_of(
        run_id,
        manifest,
        base.version,
        base.cert,
        committee,
        state.state_hash,
        {i.digest: (i.peer_id, 4, 4 * 64) for i in inputs},
        [i.digest for i in inputs],
        {},
        0,
        state.update_hash,
        params_hash=params_hash or certified_params_hash(state, manifest.rules),
    )
    sigs = {p: sign_body(BY_ID[p], body) for p in body.committee}
    return with_roster(manifest, base.cert, parse_certificate(assemble(body, sigs), run_id=run_id))


def committee_versions(
    run_id: str, manifest: RunManifest, versions: int, seed: int = 0
) -> list[CertifiedState]:
    """Genesis and ``versions`` certified states made by a committee that held them all."""
    states = [small_genesis(manifest)]
    for v in range(versions):
        base = states[-1]
        inputs = round_inputs(base, seed=seed + v)
        _, state = next_state(base, inputs, manifest.rules, OUTER)
        state.cert = certify(run_id, manifest, base, state, inputs)
        states.append(state)
    return states


@pytest.mark.parametrize("codec", CODECS)
def test_a_follower_reaches_exactly_the_certified_parameters_for_every_codec(codec: str) -> None:
    run_id, manifest = make_run(codec)
    committee = committee_versions(run_id, manifest, 3)
    follower = CertifiedState(0, None, dict(committee[0].params), None)  # parameters alone
    for state in committee[1:]:
        assert state.cert is not None and state.update is not None
        assert state.cert.body.params_hash == state.params_hash != state.state_hash
        follower = apply_update(follower, state.cert, state.update, manifest.rules, OUTER)
        assert follower.params_hash == state.cert.body.params_hash
        assert not follower.committee_state and follower.version == state.version
        for n, t in state.params.items():
            assert torch.equal(follower.params[n], t)
    last = committee[-1]
    assert last.momentum is not None and set(last.residual) == set(last.params)
    if codec == "topk2":  # a sparse update: about 1/64 of the entries, the rest fed back
        numel = sum(t.numel() for t in last.params.values())
        assert last.update is not None and len(last.update) < 8000  # its JSON header included
        kept = sum(int((r == 0).sum()) for r in last.residual.values())
        assert kept < numel / 10  # the residual holds nearly every entry


def test_the_residual_carries_what_was_not_sent() -> None:
    """Sent plus residual is the whole step: what the parameters would have moved by without a
    codec, plus the residual before (error feedback, up to fp32 rounding)."""
    run_id, manifest = make_run("topk2")
    base = small_genesis(manifest)
    exact = next_state(base, round_inputs(base), SyncRules(aggregation="mean"), OUTER)[1]
    _, state = next_state(base, round_inputs(base), manifest.rules, OUTER)
    for n, p in state.params.items():
        sent = p - base.params[n]
        step = exact.params[n] - base.params[n]
        assert torch.allclose(sent + state.residual[n], step, atol=1e-6)
        assert state.momentum is not None and exact.momentum is not None
        assert torch.equal(state.momentum[n], exact.momentum[n])  # the exact g steps it


def test_the_simulator_merges_as_the_committee_certifies() -> None:
    """``simulate``'s merge (``merge_fragment``) keeps the residual as the certified state does:
    the same parameters, momentum and residual, round after round."""
    run_id, manifest = make_run("topk2", update_k=32)
    committee = committee_versions(run_id, manifest, 3)
    theta = {n: t.clone() for n, t in committee[0].params.items()}
    momentum: dict[str, torch.Tensor] = {}
    residual: dict[str, torch.Tensor] = {}
    for v, state in enumerate(committee[1:]):
        inputs = round_inputs(committee[v], seed=v)
        merge_fragment(
            theta,
            momentum,
            [dict(i.delta) for i in inputs],
            [4 * 64] * len(inputs),
            sorted(theta),
            rules=manifest.rules,
            outer=OUTER,
            residual=residual,
        )
        assert state.momentum is not None
        for n in theta:
            assert torch.equal(theta[n], state.params[n])
            assert torch.equal(momentum[n], state.momentum[n])
            assert torch.equal(residual[n], state.residual[n])


def test_a_tampered_update_or_certificate_is_refused() -> None:
    run_id, manifest = make_run("topk2")
    genesis, state = committee_versions(run_id, manifest, 1)
    assert state.update is not None and state.cert is not None
    follower = CertifiedState(0, None, dict(genesis.params), None)
    flipped = bytearray(state.update)
    flipped[-1] ^= 1
    with pytest.raises(UpdateError) as e:
        apply_update(follower, state.cert, bytes(flipped), manifest.rules, OUTER)
    assert e.value.code is Reason.DIGEST_MISMATCH
    # Committee-signed, but naming parameters the update does not give: refused on the hash.
    lying = certify(run_id, manifest, genesis, state, round_inputs(genesis), params_hash="ab" * 32)
    with pytest.raises(UpdateError) as e:
        apply_update(follower, lying, state.update, manifest.rules, OUTER)
    assert e.value.code is Reason.STATE_MISMATCH
    # A certificate that names no params hash cannot be followed without the committee state.
    bare = certify(run_id, make_run("int8", "gradient")[1], genesis, state, round_inputs(genesis))
    assert bare.body.params_hash is None
    with pytest.raises(UpdateError) as e:
        apply_update(follower, bare, state.update, manifest.rules, OUTER)
    assert e.value.code is Reason.NOT_FOUND


def test_honest_syncers_make_bit_identical_sparse_updates() -> None:
    rules = make_run("topk2")[1].rules
    base = genesis_state(make_run("topk2")[1])  # the model's tensors: a real merge's size
    assert set(base.residual) == set(base.params)  # zero at genesis, beside the momentum
    threads = torch.get_num_threads()
    made = []
    try:
        for n_threads in (1, 2):  # two syncers, one input set, different thread counts
            torch.set_num_threads(n_threads)
            made.append(next_state(base, round_inputs(base, seed=7), rules, OUTER)[1])
    finally:
        torch.set_num_threads(threads)
    a, b = made
    assert a.update == b.update and a.state_hash == b.state_hash


def test_ties_keep_the_lowest_offsets() -> None:
    """The update codec's top-k is one answer for any build: among magnitudes equal to the
    k-th largest, the lowest offsets (a delta codec may pick any)."""
    x = torch.zeros(8192)
    x[[5, 100, 4200]] = torch.tensor([2.0, -1.0, 3.0])
    x[[7, 9, 4096, 4097, 8000]] = 0.5
    enc = TopKCodec(k=4, lowest_ties=True).encode(x)
    kept = TopKCodec(k=4).decode(enc).nonzero().view(-1).tolist()
    assert kept == [5, 7, 9, 100, 4096, 4097, 4200, 8000]
    codec = rules_codec(make_run("topk2", update_k=16)[1].rules)
    assert isinstance(codec, TopKCodec) and codec.k == 16 and codec.lowest_ties


def serving(hub: MemoryHub, tmp_path: Path, peer: str, run_id: str, *states: Any) -> ChainStore:
    """``peer`` serves ``states`` as a node's chain does."""
    chain = ChainStore(tmp_path / peer[-8:], run_id)
    for s in states:
        chain.install(s)

    async def handler(op: str, _peer: str, control: dict[str, Any], _frames: list[bytes]) -> Any:
        if op not in ("cert", "index", "chunk", "update"):
            raise RpcRefused(Reason.UNKNOWN_OP, op)
        return chain.serve(op, control)

    hub.handlers[peer] = (handler, request_limits(1 << 20), None)
    return chain


def test_a_syncer_joining_a_committee_merges_as_one_that_was_there_all_along(
    tmp_path: Path,
) -> None:
    run_id, manifest = make_run("topk2")
    committee = committee_versions(run_id, manifest, 3)
    chain = [s.cert for s in committee[1:] if s.cert is not None]
    hub = MemoryHub()
    member, follower_id = KEYS[1].peer_id, KEYS[3].peer_id
    serving(hub, tmp_path, member, run_id, *committee[-2:])
    # A follower holds version 1's parameters alone, then follows versions 2 and 3 by update.
    v1 = committee[1]
    assert v1.cert is not None and v1.update is not None
    follower = apply_update(
        CertifiedState(0, None, dict(committee[0].params), None),
        v1.cert,
        v1.update,
        manifest.rules,
        OUTER,
    )
    me = hub.transport(follower_id)
    follower = asyncio.run(follow_updates(me, manifest, follower, chain[1:], lambda c: [member]))
    assert follower.version == 3 and not follower.committee_state
    got_updates = hub.received[follower_id]
    # Its own chain serves the parameters alone, and refuses the whole state it lacks.
    mine = serving(hub, tmp_path, follower_id, run_id, follower)
    with pytest.raises(RpcRefused):
        mine.serve("index", {"version": 3})
    assert mine.serve("index", {"version": 3, "part": "params"})[0]["state_hash"] == (
        chain[-1].body.params_hash
    )
    # Elected: it downloads the committee state of version 3, checked against the state hash.
    full = asyncio.run(download_state(me, chain[-1], [member], part="committee")).state
    assert full.state_hash == chain[-1].body.state_hash and full.committee_state
    last = committee[-1]
    assert full.momentum is not None and last.momentum is not None
    for n in last.params:
        assert torch.equal(full.params[n], follower.params[n])
        assert torch.equal(full.momentum[n], last.momentum[n])
        assert torch.equal(full.residual[n], last.residual[n])
    assert hub.received[follower_id] - got_updates > full.blob().index.total_bytes
    # Both merge round 4: bit for bit the same state, update and parameters.
    inputs = round_inputs(last, seed=9)
    _, theirs = next_state(last, inputs, manifest.rules, OUTER)
    _, ours = next_state(full, inputs, manifest.rules, OUTER)
    assert ours.state_hash == theirs.state_hash and ours.update == theirs.update
    assert ours.params_hash == theirs.params_hash
    # Without the committee state there is nothing to merge on.
    with pytest.raises(ValueError, match="committee state"):
        next_state(follower, inputs, manifest.rules, OUTER)


def test_a_learner_late_to_the_run_downloads_the_parameters_alone(tmp_path: Path) -> None:
    run_id, manifest = make_run("topk2")
    committee = committee_versions(run_id, manifest, 1)
    cert = committee[1].cert
    assert cert is not None
    hub = MemoryHub()
    serving(hub, tmp_path, KEYS[1].peer_id, run_id, committee[1])
    got = asyncio.run(
        download_state(hub.transport("late"), cert, [KEYS[1].peer_id], part="params")
    ).state
    assert not got.committee_state and got.params_hash == cert.body.params_hash
    assert hub.received["late"] < committee[1].blob().index.total_bytes / 2.5  # not 3 × 4 B


def test_a_restarted_follower_resumes_its_parameters(tmp_path: Path) -> None:
    run_id, manifest = make_run("int8")
    genesis, state = committee_versions(run_id, manifest, 1)
    assert state.cert is not None and state.update is not None
    follower = apply_update(
        CertifiedState(0, None, dict(genesis.params), None),
        state.cert,
        state.update,
        manifest.rules,
        OUTER,
    )
    ChainStore(tmp_path, run_id).persist([state.cert], follower)
    back = ChainStore(tmp_path, run_id).restore()
    assert back is not None and not back.committee_state
    assert back.params_hash == state.cert.body.params_hash and back.update == state.update


def test_a_sparse_update_needs_the_params_form_and_old_manifests_keep_their_bytes() -> None:
    with pytest.raises(UnsupportedManifest) as e:
        check_supported(make_run("topk2", "gradient")[1])
    assert "\n" not in str(e.value) and "update_form" in str(e.value)
    check_supported(make_run("topk2", "params")[1])
    with pytest.raises(UnsupportedManifest):
        check_supported(make_run("int8", "params", update_k=16)[1])
    # Rules and bodies of before ADR 0064 serialise without the new fields: the same run id,
    # the same signed body bytes, the same genesis state.
    # (Recorded at protocol 10; protocol 11 is the only difference from that run.)
    old = make_run("int8", "gradient")[1].model_copy(
        update={"created_at": 1.0, "protocol_version": 10}
    )
    dumped = old.model_dump(mode="json")
    assert "update_form" not in dumped["rules"] and "update_k" not in dumped["rules"]
    assert run_id_of(RunManifest.model_validate(json.loads(json.dumps(dumped)))) == run_id_of(old)
    assert run_id_of(old) == OLD_RUN_ID
    assert genesis_state(old).state_hash == OLD_GENESIS_HASH
    body = CertificateBody.model_validate(OLD_BODY)
    assert body.params_hash is None and body.model_dump(mode="json") == OLD_BODY


def test_gradient_runs_certify_the_states_of_before() -> None:
    """The merge of a run without ``update_form`` is byte for byte the merge of before (hashes
    recorded with the code before ADR 0064)."""
    run_id, manifest = make_run("int8", "gradient")
    base = genesis_state(manifest)
    _, state = next_state(base, round_inputs(base, seed=4), manifest.rules, OUTER)
    assert not state.residual and certified_params_hash(state, manifest.rules) is None
    assert (state.state_hash, state.update_hash) == OLD_ROUND


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_nodes_follow_sparse_updates_and_newly_elected_members_fetch_the_committee_state(
    tmp_path: Path,
) -> None:
    from p2pdiloco.testing.memnet import MemoryNetwork

    async def main() -> None:
        rules = {
            "update_codec": "topk2",
            "update_form": "params",
            "grace": 20.0,
            "min_quorum_fraction": 1.0,  # every learner's delta merged: every one electable
            "trust_min_accepted": 0,
            "trust_min_age": 0,
        }
        async with MemoryNetwork(
            tmp_path, nodes=5, committee_size=3, aggregation="mean", rules=rules
        ) as net:
            await net.wait_for(lambda: net.min_version() >= 4, 240, "four versions")
            updates = sum(n.runtime.tally.updates for n in net.live())
            assert updates >= 3  # versions followed by their sparse update
            params: dict[int, str] = {}
            for node in net.live():
                for v, raw in node.runtime.chain.certs.items():
                    body = parse_certificate(raw, run_id=net.run_id).body
                    assert body.params_hash is not None
                    assert params.setdefault(v, body.params_hash) == body.params_hash
                cur = node.runtime.chain.current
                assert cur is not None and cur.params_hash == params[cur.version]
            # Committees of 3 of 5 change: members new to one merged on downloaded state.
            committees = [
                set(parse_certificate(raw, run_id=net.run_id).body.committee)
                for raw in net.nodes[0].runtime.chain.certs.values()
            ]
            assert len(set().union(*committees)) > 3
            # Nobody fell behind, so every whole-state download was a new member's.
            fetched = [d for n in net.live() for d in n.runtime.tally.downloads]
            assert fetched and all(d["version"] >= 1 for d in fetched)
            for node in net.live():  # and what it fetched is the certified committee state
                cur = node.runtime.chain.current
                assert cur is not None and cur.cert is not None
                if cur.committee_state:
                    assert cur.state_hash == cur.cert.body.state_hash

    asyncio.run(main())


# Recorded with the code before ADR 0064 (main at 197f8f5) by this file's helpers: the run id
# of ``make_run("int8", "gradient")`` created at 1.0, its genesis state, the state and update
# hash of ``test_gradient_runs_certify_the_states_of_before`` and that round's body.
OLD_RUN_ID = "be090c16b105f5978efcaa47698c06f9c81992f94f755a6917b31382b44fc241"
OLD_GENESIS_HASH = "0a09b574673798e853f36540a50b1a55b731a7937320a63030547c3370f0c19e"
OLD_ROUND = (
    "0541469d53e3fef3b34df750ecc72e65dfc48cc018f7843a695bed119d3da7e0",
    "39c50cd32122662e018092c0e91ba4dc4d1f252c03194234796f5738b573e8e5",
)
OLD_BODY: dict[str, Any] = json.loads(
    '{"run":"be090c16b105f5978efcaa47698c06f9c81992f94f755a6917b31382b44fc241","version":1,"base_version":0,"view":0,"state_hash":"0541469d53e3fef3b34df750ecc72e65dfc48cc018f7843a695bed119d3da7e0","update_hash":"39c50cd32122662e018092c0e91ba4dc4d1f252c03194234796f5738b573e8e5","committee":["12D3KooWLwstWxEv1FHD6eZwDXW51mziy62iwHCFmjwypDNeFeGt","12D3KooWBkD6CtKYLXji7KUyRxyFQzmUt7oHjXJmopCfMuqzKoxA","12D3KooWG6RfwaaCPxQhreGj5boAEqTLnxM22EQLqxZMRmZ9NEmX","12D3KooWASer5j3dfshG8gJhY89ER6qPhLvNS9P39aNUKwuvUpqV"],"quorum":3,"accepted":[{"peer_id":"12D3KooWASer5j3dfshG8gJhY89ER6qPhLvNS9P39aNUKwuvUpqV","digest":"0400040004000400040004000400040004000400040004000400040004000400","steps":4,"tokens":256},{"peer_id":"12D3KooWG6RfwaaCPxQhreGj5boAEqTLnxM22EQLqxZMRmZ9NEmX","digest":"0401040104010401040104010401040104010401040104010401040104010401","steps":4,"tokens":256},{"peer_id":"12D3KooWBkD6CtKYLXji7KUyRxyFQzmUt7oHjXJmopCfMuqzKoxA","digest":"0402040204020402040204020402040204020402040204020402040204020402","steps":4,"tokens":256}],"rejected":[],"roster_hash":"ef2be633fa52582705360cbf28b3dc8270252f9f766177c8fc631d8350ab2b9d"}'
)
