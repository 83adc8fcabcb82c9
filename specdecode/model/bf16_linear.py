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


AVX2_MAX_ROWS = 65
"""Rows up to which the AVX2 kernel takes a bf16 linear: one token, or the verification of a chain or of a tree of
up to 64 nodes (specdecode.tree.MAX_TREE_NODES) plus its root. Longer forwards (prefill) take fp32 matmuls on
chunks of the weights (`fp32_linear_by_chunks`), whose rows are not independent of each other."""


FP32_CHUNK_CHANNELS = 256
"""Output channels per fp32 copy in `fp32_linear_by_chunks`: 256 x 8960 fp32 weights (9 MB) stay in a
Zen 3's L3 between their conversion and their matmul."""


def fp32_linear_by_chunks(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
                          chunk: int = FP32_CHUNK_CHANNELS) -> torch.Tensor:
    """x [M, K] (rounded to bf16 first, as the kernels do) times the bf16 weights packed for the AVX2 kernel
    (`native_layouts.pack_bf16_avx2`: [groups, K, 16], N = n) + bias, in fp32 -> [M, N].

    Converting the whole weight to fp32 per call writes and re-reads twice its bytes in memory, a large part of
    a prefill's time on an AVX2 CPU; a chunk at a time converts into cache and multiplies from there."""
    xf = x.to(torch.bfloat16).float().t()  # [K, M]
    groups, k, width = packed.shape
    per = max(1, chunk // width)  # groups per chunk
    yt = torch.empty(groups * width, x.shape[0])  # [N rounded up to groups, M]
    buf = torch.empty(k * min(groups, per) * width)
    for g0 in range(0, groups, per):
        g1 = min(groups, g0 + per)
        w = native_gemm.unpack_bf16_avx2_to_f32(packed[g0:g1], buf[: k * (g1 - g0) * width].view(k, -1))
        torch.mm(w.t(), xf, out=yt[g0 * width : g1 * width])  # [chunk channels, M]
    yt = yt[:n]
    if bias is not None:
        yt += bias.float()[:, None]
    return yt.t().contiguous()


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
        """A CPU without AVX512 (oneDNN's bf16 matmul refuses to run): our AVX2 kernel for a few rows,
        fp32 matmuls for prefill (`AVX2_MAX_ROWS`)."""
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
        if self.avx2 and x.numel() // shape[-1] > AVX2_MAX_ROWS:
            # torch's bf16 matmul has no fast path here: fp32 matmuls on chunks of the weights
            y = fp32_linear_by_chunks(x.reshape(-1, shape[-1]), self.packed_avx2, self.out_features, self.bias)
            return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)  # [..., N]
        if self.avx2:
            y = native_gemm.bf16_gemm_avx2(x, self.packed_avx2, self.out_features, self.bias)  # [M, N], x's dtype
        else:
            y = native_gemm.bf16_gemm(x, self.weight, self.bias)
        return y.reshape(*shape[:-1], y.shape[-1])
