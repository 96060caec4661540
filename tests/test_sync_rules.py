"""The run's sync rules: ``RunManifest.rules`` (signed, bounded, round-tripped) and
check_supported, which refuses a manifest this build cannot follow with one clear line."""

from __future__ import annotations

from typing import Any

import pytest

from p2pdiloco.aggregate import RULES
from p2pdiloco.compress import CODECS
from p2pdiloco.errors import UserError
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import (
    PROTOCOL_VERSION,
    IncompatibleProtocol,
    RunManifest,
    SyncRules,
    parse_manifest,
    run_id_of,
)
from p2pdiloco.protocol.signing import InvalidRecord, open_envelope, seal
from p2pdiloco.sync.rules import UnsupportedManifest, check_supported

CREATOR = Identity.from_seed(b"\x05" * 32)
NOW = 1_800_000_000.0


def manifest(**over: Any) -> RunManifest:
    return RunManifest.model_validate(body(**over))


def body(**over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "rules-test",
        "model": "gemma-tiny",
        "data": "embedded",
        "seed": 0,
        "creator": CREATOR.peer_id,
        "created_at": 1_800_000_000.0,
        "committee_size": 4,
        "inner_steps": 20,
    }
    out.update(over)
    return out


def parse(over: dict[str, Any]) -> tuple[str, RunManifest]:
    raw = seal(CREATOR, "manifest", "", body(**over), ts=NOW)
    return parse_manifest(open_envelope(raw, now=NOW))


def refusal(m: RunManifest) -> str:
    with pytest.raises(UnsupportedManifest) as info:
        check_supported(m)
    assert isinstance(info.value, UserError)
    msg = str(info.value)
    assert "\n" not in msg and "rules-test" in msg
    return msg


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("codec", CODECS)
def test_every_rule_and_codec_of_this_build_is_supported(rule: str, codec: str) -> None:
    check_supported(manifest(rules={"aggregation": rule}, compression=codec))


def test_rule_params_the_rule_takes_are_supported() -> None:
    check_supported(manifest(rules={"aggregation": "trimmed_mean", "aggregation_params": {"f": 2}}))
    check_supported(
        manifest(
            rules={"aggregation": "centered_clip", "aggregation_params": {"tau": 0.5, "iters": 4}}
        )
    )


def test_unknown_rule_names_it_and_what_this_build_has() -> None:
    msg = refusal(manifest(rules={"aggregation": "bulyan"}))
    assert "'bulyan'" in msg and "lacks" in msg
    assert all(r in msg for r in RULES)


@pytest.mark.parametrize(
    ("rule", "params", "needle"),
    [
        ("trimmed_mean", {"g": 1.0}, "takes ['f']"),
        ("trimmed_mean", {"f": 1.5}, "integer"),
        ("mean", {"f": 1.0}, "no parameters"),
        ("centered_clip", {"tau": -1.0}, "tau"),
    ],
)
def test_rule_params_the_rule_refuses(rule: str, params: dict[str, float], needle: str) -> None:
    msg = refusal(manifest(rules={"aggregation": rule, "aggregation_params": params}))
    assert rule in msg and "refuses" in msg and needle in msg


def test_unknown_codec_names_it_and_what_this_build_has() -> None:
    msg = refusal(manifest(compression="int2"))
    assert "'int2'" in msg and "lacks" in msg
    assert all(c in msg for c in CODECS)


def test_fragments_need_h_a_multiple_of_them_and_staleness_zero() -> None:
    check_supported(manifest(outer={"fragments": 2}, inner_steps=20))  # ADR 0032
    msg = refusal(manifest(outer={"fragments": 3}, inner_steps=20))
    assert "3 fragments every 20 inner steps" in msg and "multiple" in msg
    msg = refusal(manifest(outer={"fragments": 2}, inner_steps=20, rules={"staleness": 1}))
    assert "staleness 1" in msg and "staleness 0" in msg


def test_protocol_1_manifest_is_refused() -> None:
    with pytest.raises(IncompatibleProtocol, match="older p2pdiloco release or create a new run"):
        parse({"protocol_version": 1, "aggregation": "mean", "staleness": 2})
    # the moved fields are no longer top-level fields
    for name, value in [("aggregation", "mean"), ("staleness", 2), ("min_quorum_fraction", 0.6)]:
        with pytest.raises(InvalidRecord, match=f"bad manifest: {name}"):
            parse({name: value})


def test_rule_defaults() -> None:
    assert manifest().rules.model_dump() == {
        "aggregation": "mean",
        "aggregation_params": {},
        "screen_norm_factor": 3.0,
        "clone_factor": None,
        "weight_cap": 0.25,
        "staleness": 0,
        "min_quorum_fraction": 0.6,
        "trust_min_accepted": 3,
        "trust_min_age": 3,
        "probation_share": 0.25,
        "committee_recency": 2,
        "roster_window": 10,
        "grace": 60.0,
        "grace_min": None,
        "linger": 3.0,
        "agree_timeout": 20.0,
        "view_timeout": None,
        "update_codec": "none",
    }
    assert manifest().rules.view_timeout_s == 3 * (60.0 + 20.0)


def test_a_view_timeout_inside_one_round_is_refused() -> None:
    with pytest.raises(ValueError, match="view_timeout must exceed"):
        SyncRules(grace=10.0, agree_timeout=5.0, view_timeout=15.0)
    assert SyncRules(grace=10.0, agree_timeout=5.0, view_timeout=16.0).view_timeout_s == 16.0


def test_manifest_rules_round_trip() -> None:
    rules = {
        "aggregation": "trimmed_mean",
        "aggregation_params": {"f": 1.0},
        "screen_norm_factor": None,
        "clone_factor": 0.25,
        "weight_cap": 0.5,
        "staleness": 0,
        "min_quorum_fraction": 0.75,
        "trust_min_accepted": 5,
        "trust_min_age": 0,
        "probation_share": 0.1,
        "committee_recency": 5,
        "roster_window": 4,
        "grace": 30.0,
        "grace_min": 5.0,
        "linger": 0.0,
        "agree_timeout": 10.0,
        "view_timeout": 90.0,
        "update_codec": "int4",
    }
    run_id, m = parse({"rules": rules})
    assert m.rules.model_dump(mode="json") == rules
    assert RunManifest.model_validate(m.model_dump(mode="json")) == m
    assert run_id_of(m) == run_id != run_id_of(manifest())
    check_supported(m)


@pytest.mark.parametrize(
    "over",
    [
        {"aggregation": "Bad Name"},
        {"aggregation_params": {f"k{i}": 1.0 for i in range(9)}},
        {"aggregation_params": {"F": 1.0}},
        {"aggregation_params": {"f": 1e12}},
        {"aggregation_params": {"f": "1"}},
        {"screen_norm_factor": 0.5},
        {"weight_cap": 0.0},
        {"weight_cap": 1.5},
        {"staleness": -1},
        {"min_quorum_fraction": 0.0},
        {"grace": 0.0},
        {"linger": -1.0},
        {"agree_timeout": 0.0},
        {"unknown": 1},
    ],
)
def test_manifest_rules_bounds(over: dict[str, Any]) -> None:
    with pytest.raises(InvalidRecord, match="bad manifest: rules"):
        parse({"rules": over})
