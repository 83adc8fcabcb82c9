"""Loading: GGUF conversion cache, config reading without weights, and clear errors for bad inputs."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specdecode.fetch import KNOWN_MODELS, resolve_model
from specdecode.hub import UnknownModelError
from specdecode.model import gguf_loader
from specdecode.model import load as load_mod
from specdecode.model.architectures import config_from_hf
from specdecode.model.config import ModelConfig, UnsupportedModelError
from specdecode.model.gguf_loader import CorruptModelError, config_from_gguf, config_from_gguf_file, open_gguf
from specdecode.model.load import load_model, read_config

SMOLLM = "smollm2-135m-instruct"
QWEN_TARGET = "qwen2.5-coder-1.5b-instruct"



def _no_weight_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every path that touches tensor data or the full GGUF reader fail loudly."""

    def boom(*args, **kwargs):
        raise AssertionError("weights (or the whole GGUF) were read")

    monkeypatch.setattr(gguf_loader, "dequantize", boom)
    monkeypatch.setattr(gguf_loader, "GGUFReader", boom)
    monkeypatch.setattr(load_mod, "iter_state_dict", boom)
    monkeypatch.setattr(load_mod, "_convert_gguf", boom)
    monkeypatch.setattr(load_mod, "open_gguf", boom)


# ---- config reading ---------------------------------------------------------------------------------


def _check_smollm_config(cfg: ModelConfig) -> None:
    assert cfg.arch == "llama"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size) == (576, 64, 1536)
    assert cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings is True and cfg.attention_bias is False
    assert cfg.rope_theta == 100000.0
    assert cfg.max_position_embeddings == 8192


@pytest.mark.real
def test_read_config_smollm_gguf(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDECODE_HOME")
    path = resolve_model(SMOLLM)  # the real cache (fetches on first use)
    monkeypatch.setenv("SPECDECODE_HOME", str(home))  # no converted copy here: the header is parsed
    _no_weight_reading(monkeypatch)
    t0 = time.perf_counter()
    cfg = read_config(path)
    assert time.perf_counter() - t0 < 5.0  # measured ~0.02 s
    _check_smollm_config(cfg)
    assert cfg.num_parameters() == pytest.approx(134.5e6, rel=0.01)


@pytest.mark.real
def test_header_config_equals_gguf_reader_config() -> None:
    path = resolve_model(SMOLLM)
    assert config_from_gguf_file(path) == config_from_gguf(open_gguf(path))


@pytest.mark.pair
def test_read_config_qwen_target_gguf(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDECODE_HOME")
    path = resolve_model(QWEN_TARGET)
    monkeypatch.setenv("SPECDECODE_HOME", str(home))
    _no_weight_reading(monkeypatch)
    t0 = time.perf_counter()
    cfg = read_config(path)
    assert time.perf_counter() - t0 < 5.0  # measured ~0.05 s (GGUFReader alone takes ~10 s: vocab)
    assert cfg.arch == "qwen2"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (28, 12, 2)
    assert (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size) == (1536, 128, 8960)
    assert cfg.vocab_size == 151936
    assert cfg.attention_bias is True and cfg.tie_word_embeddings is False
    assert cfg.rope_theta == 1e6
    assert cfg.max_position_embeddings == 32768
    assert cfg.num_parameters() == pytest.approx(1.78e9, rel=0.01)


def test_read_config_hf_dir(tiny_qwen_dir: Path) -> None:
    hf = json.loads((tiny_qwen_dir / "config.json").read_text())
    cfg = read_config(tiny_qwen_dir)
    assert cfg.arch == "qwen2" and cfg.attention_bias
    assert cfg.vocab_size == hf["vocab_size"] and cfg.num_layers == hf["num_hidden_layers"]
    assert cfg.num_kv_heads == hf["num_key_value_heads"] and cfg.head_dim == hf["hidden_size"] // 4
    assert cfg.rope_theta == 100000.0


# ---- GGUF load and the converted cache ----------------------------------------------------------------


@pytest.mark.real
def test_smollm_gguf_converts_once_then_loads_from_cache(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDECODE_HOME")
    real = resolve_model(SMOLLM)
    monkeypatch.setenv("SPECDECODE_HOME", str(home))
    gguf = home / "models" / "smol.gguf"
    gguf.symlink_to(real)  # a GGUF inside an empty cache: the first load must convert it
    try:
        first = load_model(str(gguf), "bf16", "cpu")
        conv = load_mod._converted_dir(gguf)
        weights = conv / "model-bfloat16.safetensors"
        assert weights.is_file() and (conv / "specdecode_config.json").is_file()
        assert (conv / "tokenizer.json").is_file() or (conv / "tokenizer_config.json").is_file()
        assert not list(conv.parent.glob(".tmp-*"))  # the temporary conversion folder is gone
        _check_smollm_config(first.config)
        assert first.model.lm_head.weight is first.model.model.embed_tokens.weight
        assert first.model.dtype == torch.bfloat16

        _no_weight_reading(monkeypatch)  # the second load must not touch the GGUF's tensors
        t0 = time.perf_counter()
        second = load_model(str(gguf), "bf16", "cpu")
        elapsed = time.perf_counter() - t0
        assert elapsed < 10.0, elapsed  # measured ~0.6 s (the conversion takes ~15 s)
        assert second.config == first.config
        sd1, sd2 = first.model.state_dict(), second.model.state_dict()
        assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
        assert second.tokenizer.encode("Hello, world!") == first.tokenizer.encode("Hello, world!")
        assert second.tokenizer.eos_token_id == first.tokenizer.eos_token_id == 2

        # The weights are the real ones: the obvious next token comes out.
        tok = second.tokenizer
        ids = tok.encode("The capital of France is")
        cache = second.model.new_cache(1, 32)
        hidden = second.model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), cache)
        logits = second.model.compute_logits(hidden)[0, -1]
        assert torch.isfinite(logits).all()
        assert tok.decode([int(logits.argmax())]).strip() == "Paris"
    finally:
        shutil.rmtree(home / "converted", ignore_errors=True)  # 270 MB


@pytest.mark.real
def test_smollm_alias_loads_from_converted_cache() -> None:
    path = resolve_model(SMOLLM)
    lm = load_model(SMOLLM, "fp32", "cpu")  # converts on the very first run, then uses the cache
    weights = load_mod._converted_dir(path) / "model-float32.safetensors"
    assert weights.is_file()
    t0 = time.perf_counter()
    again = load_model(SMOLLM, "fp32", "cpu")
    assert time.perf_counter() - t0 < 10.0  # measured ~1 s
    assert again.path == path and again.name == SMOLLM
    assert torch.equal(again.model.model.embed_tokens.weight, lm.model.model.embed_tokens.weight)


# ---- damaged and unsupported inputs --------------------------------------------------------------------


def _write_truncated_smollm(dest: Path, nbytes: int) -> Path:
    with open(resolve_model(SMOLLM), "rb") as f:
        dest.write_bytes(f.read(nbytes))
    return dest


@pytest.mark.real
def test_truncated_gguf_in_cache_is_reported_and_removed(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDECODE_HOME")
    resolve_model(SMOLLM)
    monkeypatch.setenv("SPECDECODE_HOME", str(home))
    bad = _write_truncated_smollm(home / "models" / "x.gguf", 1 << 20)
    marker = bad.with_name(bad.name + ".sha256")
    marker.write_text("0" * 64 + "  x.gguf\n")
    with pytest.raises(CorruptModelError, match="x.gguf") as info:
        load_model(str(bad), "fp32", "cpu")
    assert isinstance(info.value, ValueError)
    assert "not a readable GGUF" in str(info.value)
    assert not bad.exists() and not marker.exists()  # the next run fetches it again
    assert not (home / "converted").exists() or not any((home / "converted").iterdir())

    # read_config (used before loading, for the memory check) reports and removes it too.
    bad = _write_truncated_smollm(home / "models" / "y.gguf", 1 << 20)
    with pytest.raises(CorruptModelError, match="y.gguf"):
        read_config(bad)
    assert not bad.exists()


@pytest.mark.real
def test_gguf_truncated_inside_tensor_data_is_corrupt(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDECODE_HOME")
    resolve_model(SMOLLM)
    monkeypatch.setenv("SPECDECODE_HOME", str(home))
    bad = _write_truncated_smollm(home / "models" / "z.gguf", 50 << 20)  # header intact, tensors cut
    assert read_config(bad).num_layers == 30  # the header alone is fine
    with pytest.raises(CorruptModelError, match="z.gguf"):
        load_model(str(bad), "bf16", "cpu")
    assert not bad.exists()


@pytest.mark.real
def test_truncated_gguf_outside_cache_is_kept(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDECODE_HOME")
    resolve_model(SMOLLM)
    monkeypatch.setenv("SPECDECODE_HOME", str(home))
    bad = _write_truncated_smollm(tmp_path / "mine.gguf", 1 << 20)
    with pytest.raises(CorruptModelError):
        load_model(str(bad), "fp32", "cpu")
    assert bad.exists()  # never delete a user's own file


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf at all" * 10, b"GGUF\x03\x00\x00\x00" + b"\xff" * 16])
def test_garbage_gguf_is_corrupt(home: Path, content: bytes) -> None:
    bad = home / "models" / "g.gguf"
    bad.write_bytes(content)
    with pytest.raises(CorruptModelError):
        read_config(bad)
    assert not bad.exists()


def _write_gguf(path: Path, arch: str) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((32, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["gpt2", "mamba"])
def test_gguf_with_unsupported_architecture(home: Path, arch: str) -> None:
    path = _write_gguf(home / "models" / f"{arch}.gguf", arch)
    for call in (lambda: read_config(path), lambda: load_model(str(path), "fp32", "cpu")):
        with pytest.raises(UnsupportedModelError, match=repr(arch)) as info:
            call()
        assert "llama" in str(info.value) and "qwen2" in str(info.value)  # says what is supported
        assert isinstance(info.value, ValueError)
    assert path.exists()  # unsupported is not damaged: the file stays


def test_hf_dir_with_unsupported_model_type(tmp_path: Path) -> None:
    d = tmp_path / "gpt2"
    d.mkdir()
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50, "n_embd": 8,
           "n_layer": 1, "n_head": 2}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({"wte.weight": torch.zeros(50, 8)}, str(d / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="'gpt2'") as info:
        load_model(str(d), "fp32", "cpu")
    assert "GPT2LMHeadModel" in str(info.value) and "llama" in str(info.value)
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        read_config(d)


@pytest.mark.parametrize(
    "key",
    ["rope_scaling", "rope_parameters"],  # transformers < 5 and >= 5 spellings
)
def test_hf_config_with_unsupported_rope_scaling(tiny_llama_dir: Path, key: str) -> None:
    hf = json.loads((tiny_llama_dir / "config.json").read_text())
    assert config_from_hf(hf).rope_theta == 10000.0  # the default rope is accepted
    hf.pop("rope_scaling", None)
    hf[key] = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 500000.0}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        config_from_hf(hf)
    hf[key] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}  # supported, but incomplete
    with pytest.raises(UnsupportedModelError, match="llama3 lacks 'low_freq_factor'"):
        config_from_hf(hf)


def test_gguf_with_rope_scaling_is_unsupported(home: Path) -> None:
    import gguf

    path = home / "models" / "yarn.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_tensor("token_embd.weight", np.zeros((32, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="yarn"):
        read_config(path)


def test_unknown_alias_lists_known_aliases(home: Path) -> None:
    with pytest.raises(UnknownModelError) as info:
        load_model("no-such-model-7b", "fp32", "cpu")
    msg = str(info.value)
    assert "no-such-model-7b" in msg
    for alias in KNOWN_MODELS:
        assert alias in msg
    assert isinstance(info.value, ValueError)
    assert not any((home / "models").iterdir())  # nothing was fetched or created


def test_missing_gguf_file_is_unknown(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError):
        load_model(str(tmp_path / "nothing.gguf"), "fp32", "cpu")


def test_unknown_dtype(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(str(tiny_llama_dir), "int3", "cpu")


def test_a_gguf_tokenizer_is_parsed_once_and_kept(home: Path, tiny_llama_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing a large vocabulary out of a GGUF takes seconds, so the first load keeps the tokenizer in the model's
    converted directory; a later weight conversion into the same directory still writes its config and weights."""
    from arch_helpers import write_gguf

    from specdecode.model.tokenizer import Tokenizer

    monkeypatch.setenv("SPECDECODE_HOME", str(home))
    path = write_gguf(tiny_llama_dir, home / "models" / "tiny.gguf")
    first = load_mod.load_tokenizer(path)
    conv = load_mod._converted_dir(path)
    assert (conv / "tokenizer_config.json").is_file() and not (conv / "specdecode_config.json").exists()
    assert not list(conv.parent.glob(".tmp-*"))

    def parse(_path: Path) -> Tokenizer:
        raise AssertionError("the GGUF's vocabulary was parsed again")

    monkeypatch.setattr(Tokenizer, "from_gguf", staticmethod(parse))
    second = load_mod.load_tokenizer(path)
    text = "def add(a, b):\n    return a + b"
    assert second.encode(text) == first.encode(text) and second.eos_token_id == first.eos_token_id
    conv_dir, weights = load_mod.converted_gguf(path, torch.float32)
    assert conv_dir == conv and weights.is_file() and (conv / "specdecode_config.json").is_file()
