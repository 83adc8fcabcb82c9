"""The `f32` linear format: the fp32 model's own weights on our fp32 kernel, so that a row's result does not
depend on the other rows of the forward (torch's fp32 matmul picks its blocking, and with it the rounding of every
row, by the number of rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.model import native_gemm, native_kernels


class F32Linear(nn.Linear):
    """An nn.Linear over the same weight and bias tensors (state dict, ties and `.weight` unchanged), computed
    by `native_gemm.f32_gemm` for fp32 inference on the CPU; anything else (autograd, another dtype or device)
    takes torch's matmul."""

    def __init__(self, linear: nn.Linear, native: bool | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        found = native_kernels.f32_library() is not None  # the AVX512 kernel, else the AVX2 one
        if native and not found:
            raise ValueError("the native fp32 kernel is not available on this machine")
        self.native = found if native is None else native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if (self.native and x.dtype == w.dtype == torch.float32 and x.device.type == "cpu" and w.is_contiguous()
                and not torch.is_grad_enabled() and (b is None or b.dtype == torch.float32)):
            y = native_gemm.f32_gemm(x, w, None if b is None else b.detach())
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, w, b)
