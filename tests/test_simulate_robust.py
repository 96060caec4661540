"""Poisoned deltas in the simulator: screening rejects them, robust rules neutralise them."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pdiloco.errors import ConfigError
from p2pdiloco.harness.simulate import SimulateConfig, run_simulation
from p2pdiloco.protocol.records import SyncRules
from p2pdiloco.train.inner import InnerConfig
from p2pdiloco.train.outer import OuterConfig


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("texts")
    words = "the model learns what the data says when every learner reads its own shard. "
    for i in range(8):
        (d / f"doc{i}.txt").write_text(f"Document number {i}. " + words * 150)
    return d


def sim(corpus_dir: Path, **kw) -> dict:
    cfg = SimulateConfig(
        learners=4,
        inner_steps=6,
        rounds=3,
        data=str(corpus_dir),
        baseline=False,
        eval_batches=2,
        inner=InnerConfig(lr=3e-3, warmup_steps=2, batch_size=4, seq_len=64),
        outer=OuterConfig(lr=0.7, momentum=0.5),
        **kw,
    )
    return run_simulation(cfg).to_dict()


@pytest.fixture(scope="module")
def clean(corpus_dir: Path) -> dict:
    return sim(corpus_dir)


def test_clean_run_accepts_everyone_and_learns(clean: dict) -> None:
    d = clean["diloco"]
    assert d["eval_loss_final"] < d["eval_loss_initial"]
    assert clean["rejected_deltas"] == [0, 0, 0, 0] and clean["accepted_deltas"] == [3, 3, 3, 3]


def test_sign_flip_hurts_mean_but_trimmed_mean_neutralises_it(
    corpus_dir: Path, clean: dict
) -> None:
    base = clean["diloco"]["eval_loss_final"]
    plain = SyncRules(screen_norm_factor=None)
    trimmed = SyncRules(
        aggregation="trimmed_mean", aggregation_params={"f": 1}, screen_norm_factor=None
    )
    attacked = sim(corpus_dir, adversaries=1, attack="sign-flip", rules=plain)
    robust = sim(corpus_dir, adversaries=1, attack="sign-flip", rules=trimmed)
    assert attacked["diloco"]["eval_loss_final"] > base * 1.03
    assert robust["diloco"]["eval_loss_final"] < base * 1.03
    assert robust["adversaries"] == [3] and robust["attack"] == "sign-flip"


def test_scaled_deltas_are_rejected_by_screening_every_round(corpus_dir: Path, clean: dict) -> None:
    out = sim(corpus_dir, adversaries=1, attack="scale")
    assert out["rejected_deltas"] == [0, 0, 0, 3]
    assert out["accepted_deltas"] == [3, 3, 3, 0]
    assert out["diloco"]["eval_loss_final"] < clean["diloco"]["eval_loss_final"] * 1.03


def test_colluders_pass_screening_and_poison_the_plain_mean(corpus_dir: Path, clean: dict) -> None:
    out = sim(corpus_dir, adversaries=2, attack="collude")  # default screening: 3 × median
    assert out["accepted_deltas"] == [3, 3, 3, 3] and out["rejected_deltas"] == [0, 0, 0, 0]
    assert out["diloco"]["eval_loss_final"] > clean["diloco"]["eval_loss_final"] * 1.03


def test_bad_rule_or_attack_is_a_config_error(corpus_dir: Path) -> None:
    with pytest.raises(ConfigError, match="unknown"):
        sim(corpus_dir, rules=SyncRules(aggregation="nope"))
    with pytest.raises(ConfigError, match="trimmed_mean"):
        sim(corpus_dir, rules=SyncRules(aggregation="trimmed_mean", aggregation_params={"g": 1}))
    with pytest.raises(ConfigError, match="attack"):
        sim(corpus_dir, adversaries=1, attack="nope")
    with pytest.raises(ConfigError, match="adversaries"):
        sim(corpus_dir, adversaries=4)


def test_sparse_deltas_with_error_feedback_learn_and_upload_about_a_hundredth(
    corpus_dir: Path, clean: dict
) -> None:
    """topk2 (1/64 of the entries at 2 bits, error feedback per learner): the run still learns,
    and the learners' upload is the encoded payload, about 1/144 of fp32."""
    sparse = sim(corpus_dir, compression="topk2")
    d, dense = sparse["diloco"], clean["diloco"]
    assert sparse["compression"] == "topk2" and sparse["accepted_deltas"] == [3, 3, 3, 3]
    assert d["eval_loss_final"] < d["eval_loss_initial"]
    down = dense["wire_bytes"] / 2  # fp32 values back to every learner, both runs
    assert (d["wire_bytes"] - down) * 100 < down


def test_an_unknown_codec_is_refused_before_any_work(corpus_dir: Path) -> None:
    with pytest.raises(ConfigError, match="unknown codec 'zip'"):
        sim(corpus_dir, compression="zip")
