"""Model registry: published parameter counts, deterministic init, checkpoints, fit refusal."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from p2pdiloco.train.checkpoint import state_hash
from p2pdiloco.train.memory import GiB, ModelTooLarge, check_fits, estimate_memory
from p2pdiloco.train.models import (
    ModelError,
    build_for_loading,
    build_model,
    get_spec,
    meta_parameter_count,
    model_names,
    param_state,
    parameter_count,
)

# Published sizes of the Gemma 3 text models (tied embeddings counted once).
PUBLISHED = {
    "gemma-270m": 268_098_176,
    "gemma-1b": 999_885_952,
    "gemma-4b": 3_880_263_168,
    "gemma-12b": 11_766_034_176,
    "gemma-27b": 27_009_346_304,
}


def test_registry_has_every_size_smallest_first() -> None:
    names = model_names()
    assert names == [
        "gemma-tiny",
        "gemma-small",
        "gemma-270m",
        "gemma-1b",
        "gemma-4b",
        "gemma-12b",
        "gemma-27b",
    ]
    counts = [parameter_count(n) for n in names]
    assert counts == sorted(counts)


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_parameter_counts_match_published(name: str, count: int) -> None:
    assert parameter_count(name) == count


@pytest.mark.parametrize("name", model_names())
def test_parameter_count_from_the_shape_equals_the_built_model(name: str) -> None:
    assert parameter_count(name) == meta_parameter_count(name)


def test_parameter_count_by_hand_for_tiny() -> None:
    s = get_spec("gemma-tiny")
    h, i, q, kv = s.hidden_size, s.intermediate_size, s.num_heads * s.head_dim, s.num_kv_heads
    kv *= s.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 4 * h + 2 * s.head_dim
    assert parameter_count("gemma-tiny") == s.vocab_size * h + s.num_layers * per_layer + h
    assert 500_000 < parameter_count("gemma-tiny") < 5_000_000
    assert 10_000_000 < parameter_count("gemma-small") < 100_000_000


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(ModelError, match="known models: gemma-tiny"):
        get_spec("gpt-5")


def test_same_seed_same_state_hash_in_two_processes() -> None:
    here = state_hash(param_state(build_model("gemma-tiny", seed=7)))
    code = (
        "from p2pdiloco.train.models import build_model, param_state;"
        "from p2pdiloco.train.checkpoint import state_hash;"
        "import torch; torch.manual_seed(12345);"  # caller RNG state must not matter
        "print(state_hash(param_state(build_model('gemma-tiny', seed=7))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here
    other = state_hash(param_state(build_model("gemma-tiny", seed=8)))
    assert other != here


def test_init_does_not_disturb_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model("gemma-tiny", seed=1)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", ["gemma-tiny", "gemma-small"])
def test_a_model_built_for_loading_is_the_seeded_one_once_loaded(name: str) -> None:
    """What learners and the evaluator build (no init draw, the state loaded next) equals the
    seeded build to the last bit: every parameter and buffer, the head still tied, the same
    logits."""
    ref = build_model(name, seed=3)
    torch.manual_seed(0)
    expected_rng = torch.rand(3)
    torch.manual_seed(0)
    model = build_for_loading(name)
    assert torch.equal(torch.rand(3), expected_rng)  # no draw from the global RNG either
    with torch.no_grad():
        for n, p in param_state(model).items():
            p.copy_(param_state(ref)[n])
    a, b = ref.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {n for n, _ in ref.named_buffers()} == {n for n, _ in model.named_buffers()}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rows = torch.randint(0, 256, (2, 16))
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(model(rows).logits, ref(rows).logits)


def test_models_built_on_many_threads_at_once_keep_the_seeded_init() -> None:
    """transformers' ``no_init_weights`` swaps torch's init functions process-wide: two threads
    inside it at once used to leave the no-ops installed for good, and every later seeded build
    in the process kept uninitialised memory (CI, stop 46: ``loss is nan`` at step 0)."""
    import threading

    reference = state_hash(param_state(build_model("gemma-tiny", seed=5)))
    init_fns = {n: getattr(torch.nn.init, n) for n in ("normal_", "zeros_", "ones_")}
    errors: list[BaseException] = []
    hashes: list[str] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                if i % 2:
                    build_for_loading("gemma-tiny", params_on_meta=i % 4 == 1)
                else:
                    hashes.append(state_hash(param_state(build_model("gemma-tiny", seed=5))))
        except BaseException as e:  # re-raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert hashes and set(hashes) == {reference}
    assert {n: getattr(torch.nn.init, n) for n in init_fns} == init_fns
    assert state_hash(param_state(build_model("gemma-tiny", seed=5))) == reference


def test_an_island_build_holds_no_parameter_memory_and_the_real_buffers() -> None:
    """What an island rank builds before sharding (island.shards): gemma-12b's 11.8 B
    parameters all on the meta device, its buffers computed; gemma-tiny's buffers equal to the
    seeded build's."""
    big = build_for_loading("gemma-12b", params_on_meta=True)
    assert all(p.is_meta for p in big.parameters())
    assert sum(p.numel() for p in big.parameters()) == PUBLISHED["gemma-12b"]
    assert not any(b.is_meta for b in big.buffers())
    tiny, ref = (
        build_for_loading("gemma-tiny", params_on_meta=True),
        build_model("gemma-tiny", seed=0),
    )
    want = dict(ref.named_buffers())
    assert {n: b for n, b in tiny.named_buffers()}.keys() == want.keys()
    assert all(torch.equal(b, want[n]) for n, b in tiny.named_buffers())
    assert tiny.lm_head.weight is tiny.model.embed_tokens.weight


def test_init_from_local_checkpoint_roundtrip(tmp_path) -> None:
    model = build_model("gemma-tiny", seed=3)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = build_model("gemma-tiny", seed=99, init_from=tmp_path / "ckpt")
    assert state_hash(param_state(loaded)) == state_hash(param_state(model))


def test_init_from_wrong_shape_or_missing_path(tmp_path) -> None:
    build_model("gemma-tiny", seed=3).save_pretrained(tmp_path / "tiny")
    with pytest.raises(ModelError, match="does not have the shape of gemma-small"):
        build_model("gemma-small", seed=0, init_from=tmp_path / "tiny")
    with pytest.raises(ModelError, match="does not exist"):
        build_model("gemma-tiny", seed=0, init_from=tmp_path / "nope")
    (tmp_path / "junk").mkdir()
    with pytest.raises(ModelError, match="cannot load checkpoint"):
        build_model("gemma-tiny", seed=0, init_from=tmp_path / "junk")


def test_memory_estimate_is_itemised_and_monotonic() -> None:
    est = estimate_memory("gemma-12b", "bf16-mixed")
    p = parameter_count("gemma-12b")
    assert est.weights == 4 * p and est.optimizer == 8 * p
    parts = (
        est.weights
        + est.gradients
        + est.optimizer
        + est.diloco_state
        + est.casts
        + est.in_flight
        + est.activations
        + est.logits
        + est.resident
    )
    assert est.total == parts + est.overhead
    assert estimate_memory("gemma-12b", "bf16").total < est.total
    totals = [estimate_memory(n).total for n in model_names()]
    assert totals == sorted(totals)


def test_too_large_model_is_refused_with_need_have_and_alternative() -> None:
    with pytest.raises(ModelTooLarge) as exc:
        check_fits("gemma-12b", torch.device("cpu"), available=24 * GiB)
    msg = str(exc.value)
    assert "gemma-12b needs about" in msg and "GiB" in msg
    assert "24.0 GiB" in msg
    # gemma-270m at its 1×4096 needs 26.8 GiB in fp32 with the logits' 12 B per token and
    # vocabulary entry and every layer's activations counted (ADR 0049), so the next one down
    assert estimate_memory("gemma-270m").total > 24 * GiB >= estimate_memory("gemma-small").total
    assert "gemma-small would fit" in msg
    assert "\n" not in msg
    assert check_fits("gemma-tiny", torch.device("cpu"), available=24 * GiB).model == "gemma-tiny"


def test_an_unknown_model_is_refused_with_the_closest_name() -> None:
    from p2pdiloco.train.model_specs import ModelError, get_spec

    with pytest.raises(ModelError, match="unknown model 'gema-tiny'; did you mean 'gemma-tiny'\\?"):
        get_spec("gema-tiny")
    with pytest.raises(ModelError) as err:
        get_spec("llama")
    assert "did you mean" not in str(err.value) and "gemma-12b" in str(err.value)
