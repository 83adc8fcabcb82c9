"""Architecture hyper-parameters of a Llama/Qwen2-family decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SUPPORTED_ARCHS = ("llama", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or an option of it is not implemented."""


@dataclass(frozen=True)
class ModelConfig:
    arch: Literal["llama", "qwen2"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    """Context length the model was trained for."""
    tie_word_embeddings: bool
    attention_bias: bool
    """Qwen2 has biases on the q/k/v projections."""

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    def num_parameters(self) -> int:
        """Parameter count as loaded (untied output matrix counted once more)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = d * self.num_heads * self.head_dim
        kv = 2 * d * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * d
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        per_layer = q + kv + o + bias + 3 * d * f + 2 * d
        emb = v * d
        return self.num_layers * per_layer + d + emb + (0 if self.tie_word_embeddings else emb)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        """Map a Hugging Face `config.json` dict."""
        model_type = cfg.get("model_type", "")
        arch = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama"}.get(model_type)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r} ({cfg.get('architectures')}); "
                f"supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        # transformers >= 5 writes the scaling into rope_parameters (rope_type "default" when none).
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise UnsupportedModelError(f"rope_scaling {scaling} is not supported")
        heads = cfg["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        )
