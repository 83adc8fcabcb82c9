"""The model families this runtime computes exactly, read from a Hugging Face `config.json` or from a GGUF's
metadata (llama.cpp's names and keys), and the weight layout differences between them.

Everything that changes the maths and is not implemented (another architecture, a RoPE scaling type, partial
rotary, biases we have no slot for, ...) is refused with `UnsupportedModelError` naming it: a model either
loads exactly or not at all.
"""

from __future__ import annotations

import numpy as np
import torch

from specdecode.model.config import SUPPORTED_ARCHS, ModelConfig, UnsupportedModelError

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma2")
"""llama.cpp's `general.architecture` names (its converter writes Mistral checkpoints as `llama`)."""

_SUPPORTED_TEXT = (
    "supported: Hugging Face model_type " + ", ".join(SUPPORTED_ARCHS) + "; GGUF general.architecture "
    + ", ".join(GGUF_ARCHS)
)


def unsupported(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{what} is not supported ({_SUPPORTED_TEXT})")


# ---- Hugging Face config.json ------------------------------------------------------------------------------


def _rope_from_hf(cfg: dict, model_type: str, head_dim: int) -> dict:
    """rope_theta and the scaling fields of ModelConfig; other scaling types and partial rotary are refused."""
    params = cfg.get("rope_parameters") or {}  # transformers >= 5 (rope_type "default" when unscaled)
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta") or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0
    partial = cfg.get("partial_rotary_factor", scaling.get("partial_rotary_factor",
                                                           params.get("partial_rotary_factor", 1.0)))
    if partial is not None and float(partial) != 1.0:
        raise unsupported(f"{model_type} with partial_rotary_factor {partial} (RoPE on part of each head)")
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    out: dict = {"rope_theta": float(theta)}
    if rope_type == "default":
        return out
    if rope_type == "llama3":
        try:
            values = tuple(float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                        "original_max_position_embeddings"))
        except KeyError as exc:
            raise UnsupportedModelError(f"rope_scaling llama3 lacks {exc.args[0]!r}: {scaling}") from exc
        if values[1] == values[2]:
            raise UnsupportedModelError(f"rope_scaling llama3 with low_freq_factor == high_freq_factor: {scaling}")
        return {**out, "rope_type": "llama3", "rope_llama3": values}
    raise UnsupportedModelError(
        f"rope_scaling type {rope_type!r} is not supported ({model_type}); supported RoPE: default, llama3"
    )


def _check_false(cfg: dict, model_type: str, *keys: str) -> None:
    for key in keys:
        if cfg.get(key):
            raise unsupported(f"{model_type} with {key}={cfg[key]!r}")


def config_from_hf(cfg: dict) -> ModelConfig:
    """The ModelConfig of a Hugging Face `config.json` dict (refusing what is not computed exactly)."""
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_ARCHS:
        raise unsupported(f"architecture {model_type!r} ({cfg.get('architectures')})")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers = cfg["num_hidden_layers"]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    gemma = model_type == "gemma2"
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise unsupported(f"{model_type} with hidden activation {act!r}")
    out = {
        "arch": model_type,
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", gemma)),
        "hidden_act": act,
        **_rope_from_hf(cfg, model_type, head_dim),
    }
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if model_type in ("llama", "mistral"):
        # HF's Llama/Mistral put attention_bias on o_proj too, and mlp_bias on the MLP: no slot for either here.
        _check_false(cfg, model_type, "attention_bias", "mlp_bias")
        out["attention_bias"] = False
        if model_type == "mistral" and window is not None:
            out.update(sliding_window=int(window), sliding_layers=tuple(range(layers)))
    elif model_type in ("qwen2", "qwen3"):
        if cfg.get("use_sliding_window") or (layer_types and "sliding_attention" in layer_types):
            raise unsupported(f"{model_type} with use_sliding_window (sliding-window layers)")
        if model_type == "qwen3":  # its attention_bias would put a bias on o_proj too: no slot for it here
            _check_false(cfg, model_type, "attention_bias")
        out["attention_bias"] = model_type == "qwen2"
        out["qk_norm"] = model_type == "qwen3"
    elif model_type == "phi3":
        out["attention_bias"] = False
        if window is not None:
            out.update(sliding_window=int(window), sliding_layers=tuple(range(layers)))
    else:  # gemma2
        _check_false(cfg, model_type, "attention_bias", "use_bidirectional_attention")
        if layer_types is None:
            layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        if set(layer_types) - {"sliding_attention", "full_attention"}:
            raise unsupported(f"gemma2 layer_types {sorted(set(layer_types))}")
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        out.update(
            attention_bias=False, gemma_norms=True,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            attn_logit_softcapping=_opt_float(cfg.get("attn_logit_softcapping", 50.0)),
            final_logit_softcapping=_opt_float(cfg.get("final_logit_softcapping", 30.0)),
        )
        if window is not None and sliding:
            out.update(sliding_window=int(window), sliding_layers=sliding)
    return ModelConfig(**out)


def _opt_float(x: object) -> float | None:
    return None if x is None else float(x)  # type: ignore[arg-type]


def hf_state_dict(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under our module names: Phi-3's fused qkv_proj and gate_up_proj are split (the
    model fuses them again, in the same order, after loading)."""
    if cfg.arch != "phi3":
        return tensors
    out = {}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, t in tensors.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            for part, w in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv]), strict=True):
                out[f"{stem}{part}.weight"] = w.contiguous()
        elif name.endswith("mlp.gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            gate, up = t.chunk(2, dim=0)
            out[f"{stem}gate_proj.weight"], out[f"{stem}up_proj.weight"] = gate.contiguous(), up.contiguous()
        else:
            out[name] = t
    return out


# ---- GGUF -----------------------------------------------------------------------------------------------------


def config_kwargs_from_gguf(meta: dict[str, object], shapes: dict[str, tuple[int, ...]]) -> dict:
    """The architecture-specific ModelConfig fields of a GGUF (the common ones are read by gguf_loader)."""
    arch = str(meta.get("general.architecture"))
    if arch not in GGUF_ARCHS:
        raise unsupported(f"GGUF architecture {arch!r}")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(
            f"rope scaling {scaling!r} ({arch}.rope.scaling.type) is not supported; supported RoPE: default, "
            "llama3 (a rope_freqs tensor)"
        )
    if "rope_factors_long.weight" in shapes or "rope_factors_short.weight" in shapes:
        raise UnsupportedModelError(f"{arch}: LongRoPE (rope_factors_long/short tensors) is not supported")
    heads = int(meta.get(f"{arch}.attention.head_count", 1))  # type: ignore[arg-type]
    hidden = int(meta.get(f"{arch}.embedding_length", 0))  # type: ignore[arg-type]
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // max(heads, 1)))  # type: ignore[arg-type]
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:  # type: ignore[arg-type]
        raise unsupported(f"{arch} with RoPE on {rope_dims} of {head_dim} head dimensions (partial rotary)")
    layers = int(meta.get(f"{arch}.block_count", 0))  # type: ignore[arg-type]
    out: dict = {"arch": arch}
    if "rope_freqs.weight" in shapes:
        n = int(np.prod(shapes["rope_freqs.weight"]))
        if n != head_dim // 2:
            raise UnsupportedModelError(f"rope_freqs has {n} values; head_dim {head_dim} needs {head_dim // 2}")
        out["rope_type"] = "freq_factors"
    window = meta.get(f"{arch}.attention.sliding_window")
    window = int(window) if window else None  # type: ignore[arg-type]
    if arch == "llama" and window:  # Mistral (llama.cpp writes it as llama) with the window recorded
        out.update(sliding_window=window, sliding_layers=tuple(range(layers)))
    elif arch == "llama" and _named_mistral(meta):
        # llama.cpp's converter drops Mistral's sliding_window (Mistral 7B v0.1: 4096 positions), and the file
        # cannot tell v0.1 from the later, windowless versions: within 4096 positions both compute the same,
        # beyond them the context is refused (LLM's max_model_len) rather than computed without the window.
        ctx = int(meta.get("llama.context_length", MISTRAL_V01_WINDOW))  # type: ignore[arg-type]
        out["max_position_embeddings"] = min(ctx, MISTRAL_V01_WINDOW)
    elif arch == "phi3" and window:  # 0: none (Phi-4)
        out.update(sliding_window=window, sliding_layers=tuple(range(layers)))
    elif arch == "qwen3":
        out["qk_norm"] = True
    elif arch == "gemma2":
        # llama.cpp's converter writes no query_pre_attn_scalar: llama.cpp uses hidden/heads for the 27B model
        # (46 layers) and head_dim otherwise, which is what the released checkpoints' configs say.
        scalar = hidden // heads if layers == 46 else head_dim
        out.update(
            hidden_act="gelu_pytorch_tanh", gemma_norms=True, query_pre_attn_scalar=float(scalar),
            # llama.cpp's defaults where a key is missing: 50 and 30 (Gemma 2's), a 4096-position window.
            attn_logit_softcapping=_opt_float(meta.get("gemma2.attn_logit_softcapping", 50.0)),
            final_logit_softcapping=_opt_float(meta.get("gemma2.final_logit_softcapping", 30.0)),
        )
        window = window or 4096
        # llama.cpp: every even layer (0, 2, ...) slides, as HF's default layer_types
        out.update(sliding_window=window, sliding_layers=tuple(range(0, layers, 2)))
    for key, ok in _GGUF_MATH_KEYS.items():
        full = f"{arch}.{key}"
        if full in meta and not (ok(meta[full], arch, head_dim)):
            raise unsupported(f"{arch} GGUF with {full} = {meta[full]!r}")
    return out


_GGUF_MATH_KEYS = {
    # llama.cpp keys that change what a layer computes, and the values under which it computes as we do.
    "attention.layer_norm_epsilon": lambda v, a, hd: False,  # LayerNorm instead of RMSNorm
    "attention.scale": lambda v, a, hd: False,
    "attention.clamp_kqv": lambda v, a, hd: not v,
    "attention.causal": lambda v, a, hd: bool(v),
    "attention.value_length": lambda v, a, hd: int(v) == hd,
    "logit_scale": lambda v, a, hd: float(v) == 1.0,
    "embedding_scale": lambda v, a, hd: float(v) == 1.0,
    "residual_scale": lambda v, a, hd: float(v) == 1.0,
    "expert_count": lambda v, a, hd: int(v) == 0,
    "use_parallel_residual": lambda v, a, hd: not v,
    "attn_logit_softcapping": lambda v, a, hd: a == "gemma2",
    "final_logit_softcapping": lambda v, a, hd: a == "gemma2",
    "rope.scaling.factor": lambda v, a, hd: float(v) == 1.0,
}


MISTRAL_V01_WINDOW = 4096


def _named_mistral(meta: dict[str, object]) -> bool:
    names = (meta.get(k) for k in ("general.name", "general.basename", "general.base_model.0.name"))
    return any("mistral" in str(n).lower() for n in names if n)


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_ARCH_LAYER_NAMES = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_NON_WEIGHTS = ("rope_freqs.weight",)
"""Tensors that are not module weights (read into the config)."""


def gguf_hf_name(arch: str, gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' for `arch`; None if unknown."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        if parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def gguf_tensor_fixup(cfg: ModelConfig, hf_name: str, arr: np.ndarray) -> np.ndarray:
    """Undo what llama.cpp's converter did to a tensor: Gemma's norm weights are stored with 1 added."""
    if cfg.gemma_norms and hf_name.endswith("norm.weight"):
        return arr.astype(np.float32) - np.float32(1.0)
    return arr
