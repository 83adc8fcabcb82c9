"""The JSON side of a saved head: its kind, its shape and the target it was trained for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from specdecode.model.config import ModelConfig

HeadKind = Literal["eagle", "medusa"]


@dataclass
class HeadConfig:
    kind: HeadKind
    target: dict[str, Any]
    """Fingerprint of the target (see fingerprint.py); a head is refused on any other model."""
    hidden_size: int
    draft_vocab_size: int
    """Rows of the head's output matrix: the target tokens most frequent in its training data, optionally
    with the tokenizer's lowest ids (heads/vocab.py; the full matrix would dominate a head's cost on a CPU).
    Each row is the target's own output row for that token."""
    intermediate_size: int = 0
    """EAGLE: MLP width of its decoder layer."""
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    num_medusa_heads: int = 0
    """Medusa: heads predicting tokens 2.. ahead of the target's own next token."""
    feature_layers: list[int] = field(default_factory=list)
    """EAGLE: empty = the head reads the target's final-norm hidden state (EAGLE-1/2). Else the target's
    residual stream entering each of these layers (ascending; num_layers = after the last), concatenated and
    fused by one linear into the head's input feature (EAGLE-3's low, middle and high features)."""
    training: dict[str, Any] = field(default_factory=dict)
    """How it was trained (data, steps, losses): informative only."""

    def layer_config(self) -> ModelConfig:
        """An EAGLE head's decoder layer, shaped like one layer of the target but narrower MLP."""
        return ModelConfig(
            arch="llama", vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=1 << 20, tie_word_embeddings=False,
            attention_bias=self.attention_bias,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice of low, middle and high features: the inputs of layers 2, L/2 and L-3."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3)})


def parse_feature_layers(text: str, num_layers: int) -> list[int]:
    """`--feature-layers`: "" (final-norm feature), "eagle3", or layer indices "2,14,25"; checked against the
    target's layer count."""
    if not text:
        return []
    if text == "eagle3":
        return eagle3_layers(num_layers)
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--feature-layers {text!r}: expected eagle3 or comma-separated layer indices") from None
    check_feature_layers(layers, num_layers)
    return layers


def check_feature_layers(layers: list[int], num_layers: int) -> None:
    if layers != sorted(set(layers)) or any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(f"feature layers {layers} must be ascending, distinct and within 0..{num_layers} "
                         f"(the target has {num_layers} layers; {num_layers} = after the last)")


def eagle_config(target_cfg: ModelConfig, fingerprint: dict[str, Any], draft_vocab_size: int,
                 intermediate_size: int | None = None, feature_layers: list[int] | None = None) -> HeadConfig:
    return HeadConfig(
        kind="eagle", target=fingerprint, hidden_size=target_cfg.hidden_size, draft_vocab_size=draft_vocab_size,
        intermediate_size=intermediate_size or 2 * target_cfg.hidden_size, num_heads=target_cfg.num_heads,
        num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim, rope_theta=target_cfg.rope_theta,
        rms_norm_eps=target_cfg.rms_norm_eps, attention_bias=target_cfg.attention_bias,
        feature_layers=list(feature_layers or []),
    )


def medusa_config(target_cfg: ModelConfig, fingerprint: dict[str, Any], draft_vocab_size: int,
                  num_heads: int = 4) -> HeadConfig:
    return HeadConfig(kind="medusa", target=fingerprint, hidden_size=target_cfg.hidden_size,
                      draft_vocab_size=draft_vocab_size, num_medusa_heads=num_heads,
                      rms_norm_eps=target_cfg.rms_norm_eps)
