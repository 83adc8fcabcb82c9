"""Models run at their GGUF quantization (`quantization="gguf"`), on tiny random models written with the `gguf`
package's writer and quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0 mixed inside the fused projections).

- the native model against an fp32 model of the same dequantized weights (the bf16 path's conversion of the
  same file): logits agree within the kernel's activation rounding, Llama's Q/K row order included;
- greedy equivalence: n-gram speculation on the native path gives plain decoding's tokens exactly, in fp32
  (module by module) and in bf16 (the native decoder stack, verification rows of several tokens);
- the model's weight bytes are the file's block bytes, and the memory estimate uses the file's size.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from safetensors.torch import load_file
from tiny_helpers import GREEDY, tiny_prompts

from specdecode import LLM
from specdecode.engine import llm as llm_module
from specdecode.model import gguf_linear, load, native_kernels
from specdecode.model.architectures import config_from_hf
from specdecode.model.gguf_linear import GGUFLinear
from specdecode.model.gguf_model import load_native, weight_bytes
from specdecode.model.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(not gguf_linear.available(), reason="GGUF kernels need AVX512-VNNI")

Q = gguf.GGMLQuantizationType
TYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q5_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q5_0,
         "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0, "output": Q.Q4_0}
HF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
      "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
      "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (the inverse of gguf_loader._unpermute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, path: Path) -> Path:
    """The HF checkpoint in `hf_dir` as a GGUF with quantized linears and embeddings (no tokenizer: the tests
    take the HF directory's)."""
    import json

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch, heads, kv = cfg["model_type"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    sd = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(config_from_hf(cfg).rope_theta)

    def put(name: str, arr: np.ndarray) -> None:
        kind = name.split(".")[-2]
        if arr.ndim == 2 and kind in TYPES:
            w.add_tensor(name, quantize(arr, TYPES[kind]), raw_dtype=TYPES[kind])
        else:
            w.add_tensor(name, arr.astype(np.float32))

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd and not cfg.get("tie_word_embeddings"):
        put("output.weight", sd["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf, g in HF.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf}.{kind}"
                if key in sd:
                    arr = sd[key]
                    if arch == "llama" and g in ("attn_q", "attn_k"):
                        arr = _permute(arr, heads if g == "attn_q" else kv)
                    put(f"blk.{i}.{g}.{kind}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    hf_dir = request.getfixturevalue("tiny_qwen_dir" if request.param == "qwen2" else "tiny_llama_dir")
    return write_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"), hf_dir


@pytest.fixture
def gguf_llm_factory(tiny_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    path, hf_dir = tiny_gguf
    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(load, "load_tokenizer", lambda _path: Tokenizer.from_dir(hf_dir))
    return lambda **kw: LLM(str(path), device="cpu", quantization="gguf", max_model_len=256, **kw)


def test_native_model_matches_dequantized_fp32(tiny_gguf: tuple[Path, Path]) -> None:
    path, _ = tiny_gguf
    native, cfg = load_native(path, torch.float32)
    assert all(m.native for m in native.modules() if isinstance(m, GGUFLinear))
    ref = load._build(cfg, {k: v for k, v in _dequantized(path, cfg)}, torch.device("cpu"))
    tokens = torch.tensor([[1, 5, 9, 42, 7, 3, 100, 12]])
    pos = torch.arange(tokens.shape[1])[None]
    with torch.inference_mode():
        a = native.compute_logits(native(tokens, pos, native.new_cache(1, 16)))
        b = ref.compute_logits(ref(tokens, pos, ref.new_cache(1, 16)))
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 0.03, rel  # int8 activations per block of 32: ~0.5% per linear, compounded over 2 layers
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85


def _dequantized(path: Path, cfg: object):  # noqa: ANN202
    from specdecode.model.gguf_loader import iter_state_dict, open_gguf

    return iter_state_dict(open_gguf(path), cfg, torch.float32)


def test_weight_bytes_are_the_files_blocks(tiny_gguf: tuple[Path, Path]) -> None:
    path, _ = tiny_gguf
    model, _ = load_native(path, torch.bfloat16)
    reader = gguf.GGUFReader(str(path))
    linear = sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" and len(t.shape) == 2)
    if "output.weight" not in {t.name for t in reader.tensors}:  # tied: the output matrix is the embeddings'
        linear += int(next(t for t in reader.tensors if t.name == "token_embd.weight").n_bytes)
    assert sum(m.weight_bytes for m in model.modules() if isinstance(m, GGUFLinear)) == linear
    assert weight_bytes(model) < path.stat().st_size


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ngram_speculation_equals_plain(gguf_llm_factory, dtype: str) -> None:  # noqa: ANN001
    plain = gguf_llm_factory(dtype=dtype)
    prompts = tiny_prompts(plain)
    prompts.append(prompts[0] * 3)  # repeats: n-gram guesses that get accepted
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    if dtype == "bf16" and native_kernels.available():  # decode and verification ran in the native stack
        assert plain.target.model._native_stack[2] is not None
    for k in (2, 5, "auto"):
        spec = gguf_llm_factory(dtype=dtype, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                                                  "prompt_lookup_min": 1})
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)]
        assert got == want, k


def test_dense_output_rows_for_a_head(tiny_gguf: tuple[Path, Path]) -> None:
    """A draft head attaching to a GGUF target sees the dequantized output matrix and embeddings, then they go."""
    from specdecode.heads.fingerprint import target_fingerprint
    from specdecode.model.gguf_model import dense_output_rows

    path, _ = tiny_gguf
    model, cfg = load_native(path, torch.bfloat16)
    ref = dict(_dequantized(path, cfg))
    with dense_output_rows(model):
        out = ref.get("lm_head.weight", ref["model.embed_tokens.weight"])
        assert torch.equal(model.lm_head.weight, out.to(torch.bfloat16))
        assert torch.equal(model.model.embed_tokens.weight, ref["model.embed_tokens.weight"].to(torch.bfloat16))
        fingerprint = target_fingerprint(model)
    assert not hasattr(model.lm_head, "weight") and model.model.embed_tokens.weight.numel() == 0
    bf16_path = load._build(cfg, {k: v.to(torch.bfloat16) for k, v in ref.items()}, torch.device("cpu"))
    assert fingerprint == target_fingerprint(bf16_path)  # a head trained on the bf16 path attaches


def test_a_gguf_target_runs_natively_by_default_in_bf16(gguf_llm_factory, tiny_gguf: tuple[Path, Path]) -> None:  # noqa: ANN001
    """quantization "auto": a .gguf target in bf16 on a CPU with the kernels keeps its blocks; fp32 (the exact
    comparison), a model directory, another device and an explicit choice keep what they ask for. (The factory
    fixture is requested for its patches: a home of its own and the tiny model's tokenizer.)"""
    path, hf_dir = tiny_gguf
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert load.resolve_quantization("auto", path, bf16, cpu) == "gguf"
    assert load.resolve_quantization("auto", path, torch.float32, cpu) == "none"
    assert load.resolve_quantization("auto", hf_dir, bf16, cpu) == "none"
    assert load.resolve_quantization("auto", path, bf16, torch.device("meta")) == "none"
    assert load.resolve_quantization("none", path, bf16, cpu) == "none"
    assert load.resolve_quantization("int8", hf_dir, bf16, cpu) == "int8"
    llm = LLM(str(path), device="cpu", dtype="bf16", max_model_len=64)
    assert llm.quantization == "gguf"
    assert all(m.native for m in llm.target.model.modules() if isinstance(m, GGUFLinear))


def test_a_gguf_draft_runs_natively_by_default_in_bf16(gguf_llm_factory, tiny_gguf: tuple[Path, Path],  # noqa: ANN001
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft's "auto" takes its .gguf blocks where a target's would (a faster catch-up over the prompt);
    elsewhere "auto" stays for the fastest single-token path, and an explicit choice is kept."""
    path, hf_dir = tiny_gguf
    monkeypatch.setattr(llm_module, "load_tokenizer", load.load_tokenizer)  # the draft's, as the fixture's
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert load.resolve_draft_quantization("auto", path, bf16, cpu) == "gguf"
    assert load.resolve_draft_quantization("auto", path, torch.float32, cpu) == "auto"
    assert load.resolve_draft_quantization("auto", hf_dir, bf16, cpu) == "auto"
    assert load.resolve_draft_quantization("int4-hybrid", path, bf16, cpu) == "int4-hybrid"
    llm = LLM(str(path), device="cpu", dtype="bf16", max_model_len=64,
              speculative_config={"method": "draft", "model": str(path)})
    assert llm.draft_quantization == "gguf"
    assert llm.draft is not None
    assert all(m.native for m in llm.draft.model.modules() if isinstance(m, GGUFLinear))
