"""The `int4` and `int4-hybrid` linear formats: weight-only int4 in groups of input channels, and its hybrid
with bf16 for prefill (drafts). They change the model: for drafts (which never change the output) or explicit
opt-in."""

from __future__ import annotations

import torch
from torch import nn

from specdecode.model import native_gemm, native_kernels, native_layouts
from specdecode.model.bf16_linear import BF16Linear


class Int4WeightLinear(nn.Module):
    """Asymmetric 4-bit groups of input channels: w = q * scale + minimum, q in 0..15.

    Our kernel (`native`, where in_features is a multiple of 128): groups of 128 input channels, a scale
    and an offset per group (0.56 bytes a weight). torch's kernel otherwise: gpt-fast's scheme, groups
    of 32."""

    def __init__(self, linear: nn.Linear, group_size: int = 32, inner_k_tiles: int = 8,
                 native: bool | None = None) -> None:
        super().__init__()
        k = linear.in_features
        if native is None:
            native = k % native_layouts.INT4_GROUP == 0 and native_kernels.available()
        elif native and k % native_layouts.INT4_GROUP:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group size {native_layouts.INT4_GROUP}")
        self.native = native_kernels.use_native(native)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()  # own copy
        if self.native:
            self._init_native(linear.weight.detach().float())
        else:
            self._init_torch(linear.weight.detach().float(), group_size, inner_k_tiles)

    def _init_native(self, w: torch.Tensor) -> None:
        n, k = w.shape
        group = native_layouts.INT4_GROUP
        groups = w.reshape(n, k // group, group)
        # Scale and minimum rounded to bf16 first, so q is chosen against the numbers the kernel uses.
        low = groups.amin(-1).to(torch.bfloat16)  # [N, G]
        scale = ((groups.amax(-1) - low.float()) / 15.0).clamp(min=1e-6).to(torch.bfloat16)  # [N, G]
        q = torch.round((groups - low.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
        self.group_size = group
        packed = native_layouts.pack_int4(q.to(torch.uint8).reshape(n, k))  # [N, K/2]
        self.packed = native_layouts.tile_rows(packed, native_layouts.INT4_TILE_ROWS)  # [N/4, K/128, 4, 64]
        self.out_features, self.in_features = n, k
        # fp32 (bf16 numbers): the kernel broadcasts them straight from memory. The offset's 128 * scale
        # undoes the kernel's decoding of q as the bf16 number 128 + q; exact in fp32.
        self.scale = scale.float()  # [N, G]
        self.offset = low.float() - 128 * self.scale  # [N, G]

    def _init_torch(self, w: torch.Tensor, group_size: int, inner_k_tiles: int) -> None:
        n, k = w.shape
        if k % group_size:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
        groups = w.reshape(n, k // group_size, group_size)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scales = ((hi - lo) / 15.0).clamp(min=1e-6)  # [N, G, 1]
        zeros = lo + scales * 8  # the kernel dequantizes (q - 8) * scale + zero
        q = torch.round((groups - lo) / scales).clamp(0, 15).to(torch.int32).reshape(n, k)
        self.group_size = group_size
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)
        # [G, N, 2] bf16 (scale, zero) pairs
        self.scales_zeros = torch.cat([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self._q = q.to(torch.uint8)  # kept only for dequantized() (tests); 1 byte a weight

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, in fp32: q * scale + minimum (native), or (q - 8) * scale +
        zero from torch's bf16 pairs."""
        if self.native:
            n, k = self.out_features, self.in_features
            q = native_layouts.unpack_int4(native_layouts.untile_rows(self.packed, n, k // 2, torch.uint8))
            n, k = q.shape
            q = q.reshape(n, k // self.group_size, self.group_size).float()
            return ((q + 128) * self.scale[..., None] + self.offset[..., None]).reshape(n, k)
        n, k = self._q.shape
        scale, zero = self.scales_zeros.float().transpose(0, 1).unsqueeze(2).unbind(-1)  # [N, G, 1] each
        q = self._q.reshape(n, k // self.group_size, self.group_size).float()
        return ((q - 8) * scale + zero).reshape(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.native:
            y = native_gemm.int4_gemm(x, self.packed, self.scale, self.offset)  # [M, N]
        else:
            x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)


class Int4HybridLinear(nn.Module):
    """int4 for the few-token forwards of drafting, bf16 for prompt prefill.

    The int4 kernel is the fastest for one token but slows down steeply with more rows (a long
    prompt would take seconds), so prefill takes the bf16 copy: more memory, no slow prefill.
    """

    def __init__(self, linear: nn.Linear, max_int4_rows: int = 8, native: bool | None = None) -> None:
        super().__init__()
        self.int4 = Int4WeightLinear(linear, native=native)
        self.bf16 = BF16Linear(linear, native=False, own=True)  # prefill only: oneDNN's packed weights are its fastest
        self.max_int4_rows = max_int4_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= self.max_int4_rows:
            return self.int4(x)
        return self.bf16(x.to(torch.bfloat16)).to(x.dtype)
