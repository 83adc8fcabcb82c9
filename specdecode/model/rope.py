"""RoPE inverse frequencies: default, Llama 3.1's `llama3` scaling (as transformers computes it), and per-frequency
divisors (a GGUF's rope_freqs tensor, which llama.cpp's converter writes for Llama 3.x instead of a key)."""

from __future__ import annotations

import math

import torch

from specdecode.model.config import ModelConfig, UnsupportedModelError


def inv_freq(cfg: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies."""
    base = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).float() / cfg.head_dim)
    )
    if cfg.rope_type == "default":
        return base
    if cfg.rope_type == "llama3":
        assert cfg.rope_llama3 is not None
        factor, low, high, old_len = cfg.rope_llama3
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / factor, base)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if cfg.rope_type == "freq_factors":
        if cfg.rope_freq_factors is None:
            raise UnsupportedModelError("RoPE frequency factors (rope_freqs) were not read from the GGUF")
        factors = torch.tensor(cfg.rope_freq_factors, dtype=torch.float32, device=device)
        if factors.numel() != base.numel():
            raise UnsupportedModelError(f"{factors.numel()} RoPE frequency factors for head_dim {cfg.head_dim}")
        return base / factors
    raise UnsupportedModelError(f"RoPE type {cfg.rope_type!r} is not supported; supported: default, llama3")
