"""``export`` and ``sample`` (issue 40): a certified version leaves a node's state directory as
a Hugging Face directory only when its chain verifies and its bytes are the certified ones;
transformers loads it to the very logits of the project's model, its byte tokenizer included.

The state directory is a node's own layout (``runtime.chain.ChainStore``): two real rounds on
gemma-tiny, merged and certified by a committee of four real keys."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from p2pdiloco.cli.app import app
from p2pdiloco.core.roster import committee_for, with_roster
from p2pdiloco.net.manifests import create_manifest
from p2pdiloco.protocol.certificates import assemble, body_digest, parse_certificate, sign_body
from p2pdiloco.protocol.identity import Identity
from p2pdiloco.protocol.records import RunManifest
from p2pdiloco.runtime.chain import ChainStore
from p2pdiloco.sync.aggregator import MergeInput
from p2pdiloco.sync.certified import CertifiedState, genesis_state, next_state
from p2pdiloco.sync.committee_msgs import body_of
from p2pdiloco.train.checkpoint import CheckpointStore
from p2pdiloco.train.configs import OuterConfig
from p2pdiloco.train.hf_export import model_from_params
from p2pdiloco.train.tokenizer import ByteTokenizer
from tests.netutil import run_cli as forked_cli

KEYS = [Identity.from_seed(hashlib.sha256(b"export%d" % i).digest()) for i in range(4)]
LEARNERS = [Identity.from_seed(hashlib.sha256(b"export-learner%d" % i).digest()) for i in range(3)]
BY_ID = {k.peer_id: k for k in KEYS}
H = 4
TEXT = "Grüße, 世界! <eos> stays bytes\n\tand <bos> too\x00\x7f"


def make_run() -> tuple[str, RunManifest, bytes]:
    return create_manifest(
        KEYS[0],
        name="export-test",
        model="gemma-tiny",
        data="embedded",
        seed=0,
        inner_steps=H,
        committee_size=4,
        compression="int8",
        genesis_committee=[k.peer_id for k in KEYS],
        rules={"aggregation": "mean"},
    )


def certified_dir(path: Path, versions: int = 2) -> tuple[str, list[CertifiedState]]:
    """A node's state directory holding ``versions`` certified versions and their chain."""
    run_id, manifest, raw = make_run()
    path.mkdir(parents=True)
    (path / "manifest.json").write_bytes(raw)
    chain = ChainStore(path, run_id)
    base, states = genesis_state(manifest), []
    for v in range(versions):
        g = torch.Generator().manual_seed(v)
        inputs = [
            MergeInput(
                f"{v}{i}".ljust(64, "a"),
                peer.peer_id,
                {n: 1e-2 * torch.randn(t.shape, generator=g) for n, t in base.params.items()},
                1.0,
            )
            for i, peer in enumerate(LEARNERS)
        ]
        _, state = next_state(base, inputs, manifest.rules, OuterConfig(lr=0.7, momentum=0.9))
        committee = committee_for(run_id, manifest, base.cert)
        senders = {i.digest: (i.peer_id, H, H * 256) for i in inputs}
        body = body_of(
            run_id,
            manifest,
            base.version,
            base.cert,
            committee,
            state.state_hash,
            senders,
            [i.digest for i in inputs],
            {},
            0,
            state.update_hash,
        )
        sigs = {p: sign_body(BY_ID[p], body) for p in body.committee}
        cert = parse_certificate(assemble(body, sigs), run_id=run_id)
        state.cert = with_roster(manifest, base.cert, cert)
        chain.persist([state.cert], state)
        states.append(state)
        base = state
    return run_id, states


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[CertifiedState]]:
    path = tmp_path_factory.mktemp("node") / "state"
    run_id, states = certified_dir(path)
    return path, run_id, states


@pytest.fixture(scope="module")
def exported(
    node: tuple[Path, str, list[CertifiedState]], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    path, run_id, _ = node
    out = tmp_path_factory.mktemp("hf") / "model"
    cli = ["export", "--run", run_id[:12], "--state-dir", str(path), "--out", str(out), "--json"]
    result = CliRunner().invoke(app, cli)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["version"] == 2 and summary["run_id"] == run_id
    return out


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_transformers_loads_the_export_to_the_projects_logits(
    node: tuple[Path, str, list[CertifiedState]], exported: Path
) -> None:
    from transformers import AutoModelForCausalLM

    _, run_id, states = node
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    } <= {p.name for p in exported.iterdir()}
    saved = load_file(str(exported / "model.safetensors"))
    for name, t in states[-1].params.items():  # the certified bytes, not a copy of a copy
        assert torch.equal(saved[name], t), name
    hf = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    ours = model_from_params("gemma-tiny", states[-1].params)
    ids = torch.tensor([[257, *ByteTokenizer().encode(TEXT)]])
    with torch.no_grad():
        want = ours(input_ids=ids).logits
        got = hf(input_ids=ids).logits
    assert got.dtype == torch.float32 and got.shape == want.shape == (1, ids.shape[1], 264)
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()

    card = (exported / "README.md").read_text()
    cert = states[-1].cert
    assert cert is not None
    assert "export-test" in card and run_id in card and body_digest(cert.body) in card
    assert "| version | 2 |" in card and f"{2 * 3 * H * 256:,}" in card  # 2 rounds × 3 learners
    assert all(k.peer_id in card for k in LEARNERS)


def test_the_exported_tokenizer_is_the_byte_tokenizer(exported: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(exported))
    byte = ByteTokenizer()
    assert len(tok) == 264
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    assert tok(TEXT, add_special_tokens=False).input_ids == byte.encode(TEXT)
    ids = tok(TEXT).input_ids
    assert ids == [byte.bos_id, *byte.encode(TEXT)]  # a document starts with <bos>
    assert tok.decode(ids, skip_special_tokens=True) == TEXT == byte.decode(ids)


def test_sample_continues_a_prompt_from_the_run_and_from_the_export(
    node: tuple[Path, str, list[CertifiedState]], exported: Path
) -> None:
    path, run_id, _ = node
    prompt = "The "
    common = ["--prompt", prompt, "--max-new-tokens", "24"]
    code, from_run, err = cli("sample", "--run", run_id[:12], "--state-dir", str(path), *common)
    assert code == 0, err
    assert from_run.startswith(prompt) and len(from_run) > len(prompt)
    code, from_dir, err = cli("sample", "--model-dir", str(exported), *common)
    assert code == 0, err
    assert from_dir == from_run  # greedy on the same certified weights
    hot = [*common, "--temperature", "1.0", "--top-k", "20", "--seed", "3"]
    one, two = (cli("sample", "--model-dir", str(exported), *hot)[1] for _ in range(2))
    assert one == two and one.startswith(prompt)

    # the real entry point, as a volunteer types it
    out = forked_cli("sample", "--state-dir", str(path), *common)
    assert out.returncode == 0 and out.stdout == from_run, out.stderr


def one_line_error(args: list[str], *needles: str) -> None:
    code, out, err = cli(*args)
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_export_refuses_what_it_cannot_verify(
    node: tuple[Path, str, list[CertifiedState]], tmp_path: Path
) -> None:
    path, run_id, _ = node
    out = str(tmp_path / "out")
    one_line_error(
        ["export", "--state-dir", str(tmp_path / "none"), "--out", out],
        "no certified state",
        "no run manifest",
    )
    one_line_error(
        ["export", "--state-dir", str(path), "--version", "7", "--out", out],
        "version 7",
        "not held here (held: 1, 2)",
    )
    one_line_error(
        ["export", "--run", "ffff" * 4, "--state-dir", str(path), "--out", out], "not ffff"
    )
    one_line_error(["export", "--out", out], "--run ID")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep me")
    one_line_error(["export", "--state-dir", str(path), "--out", str(busy)], "not an empty")
    assert (busy / "x").read_text() == "keep me"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))

    # A forged certificate for version 2: the chain verifies up to 1 only.
    forged = tmp_path / "forged"
    shutil.copytree(path, forged)
    cert_file = forged / "certs" / f"{2:08d}.json"
    obj = json.loads(cert_file.read_bytes())
    obj["body"]["accepted"][0]["tokens"] = 10**12
    cert_file.write_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())
    one_line_error(
        ["export", "--state-dir", str(forged), "--version", "2", "--out", out],
        "does not verify up to version 2 (verified: 1)",
        "signatures",
    )
    code, stdout, err = cli("export", "--state-dir", str(forged), "--out", out, "--json")
    assert code == 0 and json.loads(stdout)["version"] == 1, err  # the newest that verifies

    # Version 2's file replaced by other weights (a valid checkpoint, but not the certified one).
    swapped = tmp_path / "swapped"
    shutil.copytree(path, swapped)
    store = CheckpointStore(swapped / "certified")
    ckpt = load_file(str(store.path_for(2)))
    ckpt = {n: t + 1e-3 if n == "model.norm.weight" else t for n, t in ckpt.items()}
    store.save(ckpt, {"version": 2, "run_id": run_id})
    one_line_error(
        ["export", "--state-dir", str(swapped), "--version", "2", "--out", str(tmp_path / "out2")],
        "not the one its certificate signs",
    )


def test_export_finds_a_run_held_here_by_its_name(
    node: tuple[Path, str, list[CertifiedState]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a volunteer types after ``run create --name``: the name, not the id (the walk of
    stop 51 met "no local state of run my-run")."""
    path, run_id, _ = node
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    runs = tmp_path / "data" / "p2pdiloco" / "runs"
    shutil.copytree(path, runs / run_id[:16])
    code, stdout, err = cli(
        "export", "--run", "export-test", "--out", str(tmp_path / "m"), "--json"
    )
    assert code == 0, err
    assert json.loads(stdout)["run_id"] == run_id and json.loads(stdout)["version"] == 2
    one_line_error(
        ["export", "--run", "other-run", "--out", str(tmp_path / "o")],
        "no local state of run other-run",
        "give its id or name",
    )
    one_line_error(
        ["export", "--run", "other-run", "--state-dir", str(path), "--out", str(tmp_path / "o")],
        "holds no run named other-run",
    )
    # Two runs of that name held here (a second state of it under another id): named, refused.
    shutil.copytree(path, runs / ("f" * 16))
    one_line_error(
        ["export", "--run", "export-test", "--out", str(tmp_path / "o")],
        "2 runs named export-test",
        "pass --run ID",
    )
    assert not (tmp_path / "o").exists()


def test_sample_refuses_a_directory_without_a_model(tmp_path: Path) -> None:
    one_line_error(["sample", "--model-dir", str(tmp_path), "--prompt", "x"], "no exported model")
    one_line_error(
        ["sample", "--model-dir", str(tmp_path), "--run", "ab", "--prompt", "x"], "not both"
    )
