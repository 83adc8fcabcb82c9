"""The weight-only `int8` and the `int8-dynamic` linear formats: int8 weights with one scale per output channel,
times floating-point activations (`int8`) or times int8 activations quantized per token at run time
(`int8-dynamic`). They change the model: for drafts (which never change the output) or explicit opt-in."""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from specdecode.model import native_gemm, native_kernels, native_layouts


class Int8WeightLinear(nn.Module):
    """int8 weights, one bf16 scale per output channel; activations stay floating point (rounded to bf16).

    All kernels take the same weights; ours (`native`, AVX512; `avx2`, AVX2 CPUs, weights re-laid out in
    groups of 16 channels) compute every row the same way whatever the number of rows, so verifying k tokens
    gives the rows of k single-token forwards bit for bit. torch's (`native=False`) reads one token's weights
    more slowly than the AVX2 kernel."""

    def __init__(self, linear: nn.Linear, native: bool | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scales = (w.abs().amax(dim=1).clamp(min=1e-8) / 127.0).to(torch.bfloat16)  # [N]
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scales
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()  # own copy
        self.out_features, self.in_features = q.shape
        self.native = native_kernels.use_native(native)
        self.avx2 = native is None and not self.native and native_kernels.avx2_int8_available()
        if self.native:
            self.tiles = native_layouts.tile_rows(q, native_layouts.INT8_TILE_ROWS)  # [N/4, K/64, 4, 64]
        elif self.avx2:
            self.packed_avx2 = native_layouts.pack_int8_avx2(q)  # [N/16, K, 16]
        else:
            self.weight = q  # [N, K]

    def dequantized(self) -> torch.Tensor:
        if self.native:
            q = native_layouts.untile_rows(self.tiles, self.out_features, self.in_features, torch.int8)
        elif self.avx2:
            q = native_layouts.unpack_int8_avx2(self.packed_avx2, self.out_features)
        else:
            q = self.weight
        return q.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.native:
            y = native_gemm.int8_gemm(x, self.tiles, self.scales)  # [M, N], fp32 or bf16 like x
        elif self.avx2:
            y = native_gemm.int8_gemm_avx2(x, self.packed_avx2, self.scales)  # [M, N], x's dtype
        else:
            y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)


def _fbgemm_prepack(q: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject:
    """FBGEMM's packed form of int8 weights `q` [N, K] with per-output-channel `scales` [N] (no bias)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("the int8-dynamic format needs PyTorch's FBGEMM kernels (x86 CPUs)")
    with warnings.catch_warnings():
        # torch 2.13 deprecates creating quantized tensors; prepacking still takes one.
        warnings.filterwarnings("ignore", message=r".*quantized tensor creation", category=UserWarning)
        qw = torch._make_per_channel_quantized_tensor(
            q, scales.double(), torch.zeros(q.shape[0], dtype=torch.int64), 0)
    prev = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        return torch.ops.quantized.linear_prepack(qw, None)
    finally:
        torch.backends.quantized.engine = prev


@functools.cache
def _activation_qmax() -> int:
    """Largest activation integer FBGEMM multiplies exactly on this CPU.

    With AVX512-VNNI its int8 GEMM accumulates u8 x s8 products straight into int32: 127. Without
    VNNI (AVX2, AVX512F) it first adds pairs of products in saturating int16, so activations must stay
    7-bit (u8 <= 127, as torch's own `reduce_range`): 63. Found by running the kernel once on a product
    that saturates on the latter.
    """
    k = 64
    packed = _fbgemm_prepack(torch.full((8, k), 127, dtype=torch.int8), torch.ones(8))
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(torch.full((1, k), 127.0), 1.0, 128, packed)
    return 127 if bool((y == 127.0 * 127.0 * k).all()) else 63


class Int8DynamicLinear(nn.Module):
    """int8 weights (per output channel) x int8 activations quantized per token at run time.

    Each input row gets its own symmetric scale absmax / qmax and is rounded to integers; the kernel
    computes the exact integer dot products (int32) times the weight scales, and the token's scale is
    applied after. torch's `linear_dynamic` would instead quantize the whole input with one scale,
    making a token's output depend on the other tokens of the forward; here verifying k tokens gives,
    bit for bit, the rows of k single-token forwards. Input and output keep the model dtype.

    Kernels: ours (`native`: AVX512-VNNI, the quantization inside the call, so one token costs one call instead
    of FBGEMM's GEMM plus torch's per-token quantization ops), else FBGEMM's, which receives the integers with
    scale 1 and zero point qmax + 1.
    """

    def __init__(self, linear: nn.Linear, native: bool | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        # Scales rounded to bf16 numbers: q * scale is then exact in fp32 (dequantized() is the weight).
        scales = (w.abs().amax(dim=1).clamp(min=1e-8) / 127.0).to(torch.bfloat16).float()  # [N]
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.out_features, self.in_features = w.shape
        self.native = native_kernels.use_native(native)
        if self.native:
            self.tiles = native_layouts.tile_rows(q)  # [N / 16, K / 64, 16, 64]
            self.weight_sums = q.sum(dim=1, dtype=torch.int32)  # [N]: undoes the kernel's +128 on activations
            self.qmax = 127  # VNNI multiplies u8 x s8 into int32 exactly
        else:
            self.packed = _fbgemm_prepack(q, scales)  # FBGEMM's object holds the only copy of the weights
            self.packed_nbytes = q.numel() * q.element_size()  # for the bandwidth report: not a tensor
            self.qmax = _activation_qmax()
        self.scales = scales
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()  # own copy

    def dequantized(self) -> torch.Tensor:
        if self.native:
            q = native_layouts.untile_rows(self.tiles, self.out_features, self.in_features, torch.int8)
            return q.float() * self.scales[:, None]
        q = torch.ops.quantized.linear_unpack(self.packed)[0].int_repr()  # a copy, rebuilt from the packed form
        return q.float() * self.scales[:, None]

    def quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token integers (as fp32) and scales [rows, 1] of x [rows, K] (fp32)."""
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30).div_(self.qmax)
        return (x / scale).round_(), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.native:
            y = native_gemm.int8_dynamic_gemm(x, self.tiles, self.out_features, self.weight_sums, self.scales,
                                                 self.bias, self.qmax)  # [M, N]
            return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)
        xq, scale = self.quantize_activations(x.reshape(-1, shape[-1]).float())
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(xq, 1.0, self.qmax + 1, self.packed)
        y = y * scale if self.bias is None else torch.addcmul(self.bias, y, scale)
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)
