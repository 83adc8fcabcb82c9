"""EAGLE-3 style fused-feature heads: the head reads the target's residual stream entering several layers
(low, middle, high) through one linear. Exact greedy output with an untrained fused head, the engine handing it
the captured layers, save/load, refusal, features with the captured layers, training and the train-head CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_helpers import GREEDY, record_rows, run_batched, tiny_prompts

from specdecode import LLM
from specdecode.heads.config import eagle3_layers, parse_feature_layers
from specdecode.heads.features import generate_features, load_shard
from specdecode.heads.modules import IncompatibleHeadError
from specdecode.heads.persist import load_head, new_head, save_head
from specdecode.heads.train import TrainOptions, train_head
from specdecode.model.fast_linear import convert_linears, target_linear_format
from specdecode.model.load import load_model

LAYERS = [0, 1, 2]  # the tiny Llama has 2 layers: its embeddings, after layer 0, after the last


@pytest.fixture(scope="module")
def fused_head(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    head = new_head(target, "eagle", torch.arange(0, target.config.vocab_size, 2), seed=3, feature_layers=LAYERS)
    assert head.fuse is not None and head.fuse.weight.shape == (64, 3 * 64)
    out = tmp_path_factory.mktemp("fused")
    save_head(head, out)
    return out


def test_feature_layer_choices() -> None:
    assert eagle3_layers(28) == [2, 14, 25] and parse_feature_layers("eagle3", 28) == [2, 14, 25]
    assert parse_feature_layers("", 28) == [] and parse_feature_layers("3,10,28", 28) == [3, 10, 28]
    for bad in ("10,3", "2,2", "29", "-1", "a,b"):
        with pytest.raises(ValueError, match="feature layers|expected eagle3"):
            parse_feature_layers(bad, 28)


@pytest.mark.parametrize("width", [None, 1])
def test_fused_random_head_greedy_equals_plain(plain_tiny, tiny_llama_dir: Path, fused_head: Path,
                                               width: int | None) -> None:
    base, ref = plain_tiny
    spec = {"method": "eagle", "model": str(fused_head), "draft_tree_width": width, "num_speculative_tokens": 4}
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    assert llm.target.model.capture_layers == tuple(LAYERS)
    outs = llm.generate(tiny_prompts(base), GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert outs[0].metrics["draft_tokens"] >= outs[0].metrics["steps"]


def test_fused_head_in_continuous_batching(plain_tiny, tiny_llama_dir: Path, fused_head: Path) -> None:
    base, ref = plain_tiny
    llm = LLM(str(tiny_llama_dir), dtype="fp32",
              speculative_config={"method": "eagle", "model": str(fused_head), "num_speculative_tokens": 3})
    seqs = run_batched(llm, tiny_prompts(base), GREEDY)
    assert [s.output_ids for s in seqs] == ref


def test_the_engine_hands_the_head_its_fused_layers(tiny_llama_dir: Path, fused_head: Path) -> None:
    """The proposer's feature at each prompt position is the head's fuse over the target's residual streams
    entering layers 0, 1 and after the last, at that position (not the final-norm hidden state)."""
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "eagle", "model": str(fused_head)})
    prompt = tiny_prompts(llm)[0]
    made = record_rows(llm)
    llm.generate([prompt], GREEDY)
    proposer = llm.engine.proposer
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    convert_linears(target, target_linear_format("none", target.dtype, target.device))  # the kernels LLM runs
    ids = torch.tensor([prompt])
    pos = torch.arange(len(prompt))[None]
    streams = [target.model.embed_tokens(ids), *_layer_outputs(target, ids, pos)]
    expected = proposer.head.fuse(torch.cat(streams, dim=-1)[0])
    torch.testing.assert_close(proposer.features[made[-1].slot][: len(prompt)], expected)


def _layer_outputs(target, ids: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:  # noqa: ANN001
    """The residual stream after each decoder layer, by running the target with every layer captured."""
    target.capture_layers = tuple(range(1, target.config.num_layers + 1))
    target(ids, pos, target.new_cache(1, ids.shape[1]))
    d = target.config.hidden_size
    return list(target.captured.split(d, dim=-1))


def test_fused_head_round_trips_and_is_refused_where_layers_are_missing(tiny_llama_dir: Path, fused_head: Path,
                                                                        tmp_path: Path) -> None:
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    head = load_head(fused_head, target, kind="eagle", dtype=torch.float32)
    assert head.config.feature_layers == LAYERS
    saved = json.loads((fused_head / "config.json").read_text())
    saved["feature_layers"] = [0, 1, 3]  # the target has 2 layers: nothing enters a fourth
    (tmp_path / "config.json").write_text(json.dumps(saved))
    (tmp_path / "head.safetensors").write_bytes((fused_head / "head.safetensors").read_bytes())
    with pytest.raises(IncompatibleHeadError, match="within 0..2"):
        load_head(tmp_path, target)


@pytest.fixture(scope="module")
def fused_features(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    loaded = load_model(str(tiny_llama_dir), "fp32", "cpu")
    loaded.model.capture_layers = tuple(LAYERS)
    out = tmp_path_factory.mktemp("fused-features")
    return generate_features(loaded.model, loaded.tokenizer, out, num_tokens=3000, shard_tokens=1000)


@pytest.fixture(scope="module")
def tiny_features(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """Final-norm features only (no captured layers)."""
    loaded = load_model(str(tiny_llama_dir), "fp32", "cpu")
    out = tmp_path_factory.mktemp("features")
    return out, generate_features(loaded.model, loaded.tokenizer, out, num_tokens=2000, shard_tokens=1000)


def test_features_keep_the_captured_layers(tiny_llama_dir: Path, fused_features: list[Path]) -> None:
    shard = load_shard(fused_features[0])
    assert shard.aux is not None and shard.aux.shape == (len(shard.tokens), 3 * 64)
    a, b = shard.sequences()[0]
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    target.capture_layers = tuple(LAYERS)
    ids = shard.tokens[a:b][None]
    hidden = target(ids, torch.arange(b - a)[None], target.new_cache(1, b - a))[0]
    torch.testing.assert_close(shard.aux[a:b].float(), target.captured[0], atol=0.05, rtol=0.02)  # bf16
    torch.testing.assert_close(shard.hidden[a:b].float(), hidden, atol=0.05, rtol=0.02)
    meta = json.loads((fused_features[0].parent / "features.json").read_text())
    assert meta["capture_layers"] == LAYERS


def test_fused_head_trains_and_drives_exact_decoding(tiny_llama_dir: Path, fused_features: list[Path],
                                                     tiny_features, tmp_path: Path) -> None:
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    opts = TrainOptions(kind="eagle", epochs=12, window=64, batch_windows=4, lr=3e-3, warmup_steps=5,
                        draft_vocab_size=200, unroll_steps=2, feature_layers=LAYERS, reg_weight=0.0,
                        ce_weight=1.0, max_steps=40)
    head = train_head(target, fused_features, tmp_path / "fused", opts, always_ids=[2])
    info = head.config.training
    loss = info["fixed_batch_loss"]  # the same windows and feature noise before and after: no sampling luck
    assert loss["end"] < 0.8 * loss["start"], loss  # measured 14.8 -> 9.9
    assert head.config.feature_layers == LAYERS
    spec = {"method": "eagle", "model": str(tmp_path / "fused")}
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    base = LLM(str(tiny_llama_dir), dtype="fp32")
    prompts = tiny_prompts(base)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in base.generate(prompts, GREEDY)]
    # Shards without the captured layers are refused for a fused head (and the other way round).
    _, plain_shards = tiny_features
    with pytest.raises(ValueError, match="generate features with those layers"):
        train_head(target, plain_shards, tmp_path / "wrong", opts, always_ids=[2])


def test_a_fused_head_starts_from_an_unfused_one(tiny_llama_dir: Path, fused_features: list[Path],
                                                 tiny_features, tmp_path: Path) -> None:
    """--init-from an EAGLE-1/2 head with --feature-layers: its layer and fc weights carry over, `fuse` is new."""
    _, plain_shards = tiny_features
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    plain = train_head(target, plain_shards, tmp_path / "plain",
                       TrainOptions(kind="eagle", epochs=1, window=64, draft_vocab_size=200, max_steps=2), [2])
    opts = TrainOptions(kind="eagle", epochs=1, window=64, max_steps=0, init_from=str(tmp_path / "plain"),
                        feature_layers=LAYERS)
    fused = train_head(target, fused_features, tmp_path / "fused", opts, always_ids=[2])
    assert fused.config.feature_layers == LAYERS and torch.equal(fused.d2t, plain.d2t)
    state = fused.saved_state()
    start = load_head(tmp_path / "plain", target, dtype=torch.float32).saved_state()  # as saved (bf16)
    assert "fuse.weight" in state and "fuse.weight" not in start
    assert all(torch.allclose(state[k].float(), v.float()) for k, v in start.items())


def test_train_head_cli_stores_fused_features_apart(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from specdecode.cli import main

    data = tmp_path / "data"
    rc = main(["train-head", "--target", str(tiny_llama_dir), "--out", str(tmp_path / "head"), "--data-dir", str(data),
               "--data-tokens", "512", "--feature-layers", "0,2", "--unroll-steps", "2", "--reg-weight", "0",
               "--epochs", "1", "--threads", "1"])
    assert rc == 0
    shards = sorted((data / "layers-0-2").glob("shard-*.safetensors"))
    assert shards and load_shard(shards[0]).aux.shape[-1] == 2 * 64
    assert not list(data.glob("shard-*.safetensors"))  # the final-norm-only features stay where they were
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["feature_layers"] == [0, 2] and saved["training"]["options"]["reg_weight"] == 0
