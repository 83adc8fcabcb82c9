"""Tiny random checkpoints of each supported family, built with transformers' own config and model classes, and
GGUF files written from them the way llama.cpp's convert_hf_to_gguf.py does (its architecture names, metadata
keys and tensor names from the `gguf` package, Q/K row permutation for `llama`, +1 on Gemma's norm weights,
Llama 3.x RoPE scaling as a rope_freqs tensor), with the tokenizer as a byte-level BPE vocabulary."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from conftest import _save_tokenizer
from gguf_helpers import add_tokenizer

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
"""With head_dim 16 and theta 5e5 the wavelengths span the three bands (kept, smoothed, divided by 8)."""


def hf_config(kind: str, vocab: int, **over: object):  # noqa: ANN201 - a transformers PretrainedConfig
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.25,
                  eos_token_id=2, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    common.update(over)
    if kind == "llama3":
        return LlamaConfig(rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0, **common)
    if kind == "qwen3":
        return Qwen3Config(head_dim=32, rope_theta=1e6, **{**common, "tie_word_embeddings": True})
    if kind == "mistral":
        return MistralConfig(**{"sliding_window": 16, "rope_theta": 10000.0, **common})
    if kind == "phi3":
        return Phi3Config(sliding_window=24, original_max_position_embeddings=512, **common)
    if kind == "gemma2":
        gemma = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=16, attn_logit_softcapping=5.0,
                     final_logit_softcapping=8.0, tie_word_embeddings=True)
        return Gemma2Config(**{**common, **gemma, **over})
    raise ValueError(kind)


def make_hf_dir(path: Path, kind: str, seed: int = 0, **over: object) -> Path:
    """Random weights (norms and biases too, so that every term matters) saved as a HF checkpoint directory."""
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    vocab = _save_tokenizer(path, 320)
    cfg = hf_config(kind, vocab, **over)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # HF initialises them to 1 (0 for Gemma's offsets)
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def reference_model(path: Path):  # noqa: ANN201 - transformers' model, fp32, eager attention
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (rotate_half layout -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg) -> np.ndarray:  # noqa: ANN001
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    rope = cfg.rope_parameters
    base, dim = rope["rope_theta"], getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2"}


def write_gguf(hf_dir: Path, out: Path, with_rope_freqs: bool = True, window_key: bool = True,
               name: str | None = None) -> Path:
    """The HF checkpoint as llama.cpp's converter writes it (all tensors F32). For Mistral the sliding window is
    recorded under `llama.attention.sliding_window` (`window_key`); the converter itself writes none for
    `llama`."""
    model = reference_model(hf_dir)
    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    n = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(out), arch)
    if name is not None:
        w.add_name(name)
    add_tokenizer(w, hf_dir)  # its tokenizer as a 'gpt2' BPE vocabulary (Tokenizer.from_gguf reads it back)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(n)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch != "gemma2":  # Gemma2Model writes no rope base (llama.cpp's default 10000 is Gemma 2's)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch in ("llama", "phi3"):
        w.add_rope_dimension_count(head_dim)
    if arch == "llama" and cfg.model_type == "mistral" and window_key and cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.detach().float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _permute(data, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = _permute(data, cfg.num_key_value_heads)
        if arch == "gemma2" and name.endswith("norm.weight"):
            data = data + 1
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        w.add_tensor(new, data)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if with_rope_freqs and rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
