"""Architecture hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2).

Hugging Face `config.json` and GGUF metadata are mapped onto it in `architectures.py`; anything this runtime does
not compute exactly is refused there with `UnsupportedModelError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Arch = Literal["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2"]
"""The families this runtime computes, by their Hugging Face `model_type`."""
SUPPORTED_ARCHS: tuple[str, ...] = get_args(Arch)


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or an option of it is not implemented."""


@dataclass(frozen=True)
class ModelConfig:
    arch: Arch
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
    rope_type: str = "default"
    """"default"; "llama3" (Llama 3.1+ frequency scaling, `rope_llama3`); "freq_factors" (per-frequency divisors
    `rope_freq_factors`: a GGUF's rope_freqs tensor, as llama.cpp's converter writes Llama 3.x scaling)."""
    rope_llama3: tuple[float, float, float, float] | None = None
    """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of `rope_type` llama3."""
    rope_freq_factors: tuple[float, ...] | None = None
    """head_dim / 2 divisors of the inverse frequencies; None in a config read from a GGUF header alone (the
    tensor is read with the weights), and then the RoPE tables refuse to build."""
    qk_norm: bool = False
    """Qwen3: RMSNorm over each head's q and k before RoPE."""
    hidden_act: str = "silu"
    """The MLP's gate activation: "silu" or "gelu_pytorch_tanh" (Gemma's GeGLU)."""
    gemma_norms: bool = False
    """Gemma 2: RMSNorm weights as offsets (x * (1 + w)), norms after attention and around the MLP, embeddings
    scaled by sqrt(hidden_size)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores scale by this ** -0.5 instead of head_dim ** -0.5 (Gemma 2)."""
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    """Layers in `sliding_layers` attend to the last `sliding_window` positions only (the query's included)."""
    sliding_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("rope_llama3", "rope_freq_factors", "sliding_layers"):  # lists after a JSON round trip
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
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
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        per_layer += 2 * d if self.gemma_norms else 0
        return self.num_layers * per_layer + d + emb + (0 if self.tie_word_embeddings else emb)

    @property
    def plain_layers(self) -> bool:
        """Llama/Qwen2 layers (SiLU MLP, pre-norms, plain softmax attention at head_dim ** -0.5, RoPE on q and k
        straight from the projection) with one sliding window for all layers or none: what the native decode
        kernels (`native_stack`, `native_kernels.rope_qkv`) compute."""
        uniform_window = self.sliding_window is None or len(self.sliding_layers) == self.num_layers
        return (not self.qk_norm and self.hidden_act == "silu" and not self.gemma_norms and uniform_window
                and self.query_pre_attn_scalar is None and self.attn_logit_softcapping is None)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of a layer; None when it attends to the whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
