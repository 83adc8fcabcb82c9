"""Tiny GGUF files for tests: tensors in any llama.cpp type (quantized by the `gguf` package where it can,
random valid blocks where it cannot), a tiny Llama with a byte-level BPE tokenizer, and damaged copies."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

T = GGMLQuantizationType
LISTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Byte offsets of each K-quant block's fp16 scales (d, dmin): random bytes there could be inf/NaN.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def encode(values: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(data to write, gguf's own dequantization of it) for fp32 values [rows, cols] in type qtype."""
    t = T[qtype]
    if qtype == "F32":
        return values, values
    if qtype == "F16":
        data = values.astype(np.float16)
        return data, data.astype(np.float32)
    if qtype in _K_SCALES:  # the gguf package cannot quantize K-quants: random valid blocks
        block, size = GGML_QUANT_SIZES[t]
        rows, cols = values.shape
        data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for off in _K_SCALES[qtype]:
            scale = rng.uniform(-0.02, 0.02, size=(rows, cols // block)).astype(np.float16)
            data[:, :, off : off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
        data = data.reshape(rows, -1)
    else:
        data = quantize(values, t)
    return data, dequantize(data, t)


def add(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: str) -> None:
    if qtype in ("F32", "F16"):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_dtype=T[qtype])


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_meta(writer: gguf.GGUFWriter, hidden: int, ff: int, layers: int, heads: int, kv_heads: int) -> None:
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer_dir: Path) -> int:
    """A byte-level BPE tokenizer (tokenizer.json of a HF directory) as llama.cpp's 'gpt2' model; its size."""
    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    for added in tj.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    return len(tokens)


_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, index, *module, kind = hf_name.split(".")  # model.layers.<i>.<module>.<weight|bias>
    return f"blk.{index}.{_LAYER['.'.join(module)]}.{kind}"


def write_tiny_gguf(hf_dir: Path, path: Path) -> Path:
    """A tiny Qwen2 HF directory of conftest as an F32 GGUF with its vocabulary (Qwen2 only: Llama GGUFs permute
    the Q/K rows); it decodes exactly as the directory does."""
    from safetensors.torch import load_file

    from specdecode.model.architectures import config_from_hf

    cfg = config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    assert cfg.arch == "qwen2", cfg.arch
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    add_tokenizer(writer, hf_dir)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        writer.add_tensor(_gguf_name(name), tensor.float().numpy())
    finish(writer)
    return path
