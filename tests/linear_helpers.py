"""Linears and bounds shared by the parity tests of the CPU linear formats (test_quantized_linears.py)
and of our weight-only kernels (test_native_kernels.py)."""

from __future__ import annotations

import torch
from torch import nn

BF16_HALF_ULP = 2.0**-8  # bf16 keeps 8 significant bits: rounding moves a value by <= 2^-8 of itself
FP32_ULP = 2.0**-23


def bf16_linear(out_features: int, in_features: int, seed: int, bias: bool = True) -> nn.Linear:
    """A Linear whose weights and bias are bf16 numbers (so the bf16 formats store them unrounded),
    with a few large input channels and output rows as real checkpoints have."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[:, :: in_features // 4] *= 8  # outlier input channels
    w[:: out_features // 8] *= 3  # rows of larger norm
    with torch.no_grad():
        lin.weight.copy_(w.bfloat16().float())
        if bias:
            lin.bias.copy_((torch.randn(out_features, generator=g) * 0.1).bfloat16().float())
    return lin


def inputs(rows: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    x[:, 3] *= 20  # an activation outlier: what makes per-token scales coarse
    return x


def check_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, rel: float,
                accumulation: bool = True) -> None:
    """|y - (x @ w.T + b)| <= rel * (|x @ w.T| + |x @ w.T + b|) [+ fp32 accumulation slack], elementwise.

    The reference is float64 (exact products of these bf16/int8 numbers; K-term sums err by ~K * 2^-53).
    `rel` bounds the roundings of the output (the product, then the sum with the bias); `accumulation`
    adds the worst case of fp32 accumulation in any order: K * 2^-24 of the sum of |products|."""
    y0 = x.double() @ w.double().t()
    ref = y0 if bias is None else y0 + bias.double()
    bound = rel * (y0.abs() + ref.abs())
    if accumulation:
        bound = bound + x.shape[-1] * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    err = (y.double() - ref).abs()
    worst = torch.where(err == 0, 0.0, err / bound).max().item()
    assert worst <= 1.0, f"error up to {worst:.3g}x the bound"
