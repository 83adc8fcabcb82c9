"""Faster CPU execution of the Linear layers, swapped in after loading.

- `packed-bf16`: the same bf16 weights, pre-packed once into oneDNN's blocked layout. The
  plain bf16 matmul re-packs on every call and runs at ~1/3 of memory bandwidth on these
  CPUs; the packed one reaches it. Exact w.r.t. the bf16 model up to accumulation order.
- `int8`: weight-only int8 with per-channel scales (`torch._weight_int8pack_mm`).
- `int4`: weight-only int4 with group-wise scales/zeros (`torch._weight_int4pack_mm_for_cpu`).
- `int4-hybrid`: int4 for forwards of a few tokens, packed bf16 for prefill (drafts).
The quantized formats change the model: for drafts (which never change the output) or
explicit opt-in.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

LinearFormat = Literal["none", "packed-bf16", "int8", "int4", "int4-hybrid"]
FORMATS: tuple[str, ...] = ("none", "packed-bf16", "int8", "int4", "int4-hybrid")


class PackedBF16Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().to(torch.bfloat16)
        self.out_features, self.in_features = w.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8WeightLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [N]
        self.weight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scales.to(torch.bfloat16)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)


class Int4WeightLinear(nn.Module):
    """Asymmetric 4-bit groups of `group_size` input channels (gpt-fast's scheme)."""

    def __init__(self, linear: nn.Linear, group_size: int = 32, inner_k_tiles: int = 8) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
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
        self._dq = (q.reshape(n, -1, group_size).float() - 8) * scales + zeros  # kept only for tests
        self._dq = self._dq.reshape(n, k).to(torch.bfloat16)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def dequantized(self) -> torch.Tensor:
        return self._dq.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)


class Int4HybridLinear(nn.Module):
    """int4 for the few-token forwards of drafting, packed bf16 for prompt prefill.

    The int4 kernel is the fastest for one token but slows down steeply with more rows (a long
    prompt would take seconds), so prefill takes the bf16 copy: more memory, no slow prefill.
    """

    def __init__(self, linear: nn.Linear, max_int4_rows: int = 8) -> None:
        super().__init__()
        self.int4 = Int4WeightLinear(linear)
        self.bf16 = PackedBF16Linear(linear)
        self.max_int4_rows = max_int4_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= self.max_int4_rows:
            return self.int4(x)
        return self.bf16(x.to(torch.bfloat16)).to(x.dtype)


_CONSTRUCTORS = {
    "packed-bf16": PackedBF16Linear,
    "int8": Int8WeightLinear,
    "int4": Int4WeightLinear,
    "int4-hybrid": Int4HybridLinear,
}


def convert_linears(model: nn.Module, fmt: LinearFormat) -> nn.Module:
    """Replace every nn.Linear (lm_head included) by the given CPU format, in place."""
    if fmt == "none":
        return model
    if fmt not in _CONSTRUCTORS:
        raise ValueError(f"unknown linear format {fmt!r}; choose one of {', '.join(FORMATS)}")
    make = _CONSTRUCTORS[fmt]
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
        del name
    return model


def target_linear_format(quantization: str, dtype: torch.dtype, device: torch.device) -> LinearFormat:
    """The target keeps its weights unless the user opts into quantization; on CPU in bf16 they are
    pre-packed (same values, faster kernel)."""
    if quantization not in ("none", "int8", "int4"):
        raise ValueError(f"quantization must be none, int8 or int4, got {quantization!r}")
    if device.type != "cpu":
        if quantization != "none":
            raise ValueError(f"quantization {quantization!r} is implemented for CPU only")
        return "none"
    if quantization != "none":
        return quantization  # type: ignore[return-value]
    return "packed-bf16" if dtype == torch.bfloat16 else "none"


def draft_linear_format(quantization: str, dtype: torch.dtype, device: torch.device) -> LinearFormat:
    """A draft never changes the output, so "auto" takes the fastest single-token path: int4 on CPU
    (measured 27 ms vs 52 ms packed bf16 per token for the 0.5B draft), with bf16 for its prefill."""
    if quantization == "auto":
        if device.type != "cpu" or dtype != torch.bfloat16:
            return "none"
        return "int4-hybrid"
    return target_linear_format(quantization, dtype, device)
