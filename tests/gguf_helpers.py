"""A tiny GGUF file written from a tiny Qwen2 checkpoint of conftest (F32 tensors, its BPE vocabulary), for
tests of the GGUF path that must not download a real model."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
from safetensors.torch import load_file

from specdecode.model.config import ModelConfig

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
    """A Qwen2 HF directory as a GGUF (no Q/K permutation: that is llama's layout only)."""
    cfg = ModelConfig.from_hf_dict(json.loads((hf_dir / "config.json").read_text()))
    assert cfg.arch == "qwen2", "Llama GGUFs permute Q/K rows; this helper writes Qwen2 only"
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    specials = {t["id"]: t["content"] for t in tok["added_tokens"]}
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([specials.get(i, s) for s, i in vocab])
    w.add_token_types([3 if i in specials else 1 for i in range(len(vocab))])  # 3 = control, 1 = normal
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        w.add_tensor(_gguf_name(name), tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
