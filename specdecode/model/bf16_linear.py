"""The `bf16` linear format: the model's own bf16 weights, the exact target's format on CPU, on the fastest kernel
this CPU has for them (our AMX, AVX512 or AVX2 kernel, else oneDNN's weights pre-packed once)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from specdecode import cpu_isa
from specdecode.model import native_gemm, native_kernels, native_layouts


def onednn_bf16_supported() -> bool:
    """oneDNN's bf16 matmul runs here: it needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT, and refuses otherwise
    (and SPECDECODE_ISA, where set, at least `avx512`)."""
    return cpu_isa.allows("avx512") and _onednn_bf16_runs()


@functools.cache
def _onednn_bf16_runs() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def bf16_uses_avx2_kernel() -> bool:
    """The bf16 format runs on our AVX2 kernel here (no AVX512-BF16 kernels; oneDNN's bf16 matmul, where it runs
    without AVX512-BF16, emulates it and costs a pass over the weights per row or two): its weights are re-laid out
    into a copy, a tied output matrix included (counted by `engine.validation.estimate_bytes`)."""
    return not native_kernels.available() and native_kernels.avx2_available()


def bf16_copies_weights() -> bool:
    """The bf16 format keeps its own re-laid-out copy of the weights here (the AVX2 or the AMX kernel), so a tied
    output matrix costs its bytes twice (`engine.validation.estimate_bytes`)."""
    return bf16_uses_avx2_kernel() or (native_kernels.available() and native_kernels.amx_available())


class BF16Linear(nn.Module):
    """The model's own bf16 weights: the exact target's format on CPU.

    With our kernels (`native`): they read the weights for one token faster than oneDNN's pre-packed ones, and
    a row's result does not depend on the other rows of the forward, at any row count (prefill included: a
    token's result is the same in a decode step, a verification, a chunk or a whole prompt). Without them:
    oneDNN's weights pre-packed once (the plain bf16 matmul re-packs on every call and reads a single token at a
    fraction of memory bandwidth), whose rounding of a row depends on the row count. On Intel CPUs with AMX,
    our AMX kernel takes every forward, prefill included (`native_gemm.bf16_gemm_amx`): a many-row verification
    there costs little more than one row, where the AVX512 kernel's bf16 dot products are slow on those cores
    (docs/kernels.md)."""

    def __init__(self, linear: nn.Linear, native: bool | None = None, own: bool = False) -> None:
        """own: copy the weights even where they are bf16 already (a quantizing conversion frees what was loaded;
        a kept view would hold the whole weights file in memory)."""
        super().__init__()
        w = linear.weight.detach().to(torch.bfloat16)
        if own and w.data_ptr() == linear.weight.data_ptr():
            w = w.clone()
        self.out_features, self.in_features = w.shape
        self.native = native_kernels.use_native(native)
        self.amx = self.native and native_kernels.amx_available()
        """Intel CPUs with AMX: our AMX kernel for every row count (prefill too), weights re-laid out."""
        self.avx2 = not self.native and bf16_uses_avx2_kernel()
        """A CPU without AVX512-BF16: our AVX2 kernel at every row count, prefill included (as fast as fp32
        matmuls on converted weights from a few hundred rows down, and rows independent)."""
        if self.amx:
            self.packed_amx = native_layouts.pack_bf16_amx(w)  # [N/64, K/32, 4, 16, 16, 2]; a copy (tied too)
        elif self.native:
            self.weight = w.contiguous()  # [N, K]
        elif self.avx2:
            self.packed_avx2 = native_layouts.pack_bf16_avx2(w)  # [N/16, K, 16]; a copy (of a tied lm_head too)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()  # own copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.native or self.avx2):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        shape = x.shape
        if self.amx:
            y = native_gemm.bf16_gemm_amx(x, self.packed_amx, self.out_features, self.bias)  # [M, N], x's dtype
            return y.reshape(*shape[:-1], y.shape[-1])
        if self.avx2:
            y = native_gemm.bf16_gemm_avx2(x, self.packed_avx2, self.out_features, self.bias)  # [M, N], x's dtype
        else:
            y = native_gemm.bf16_gemm(x, self.weight, self.bias)
        return y.reshape(*shape[:-1], y.shape[-1])
