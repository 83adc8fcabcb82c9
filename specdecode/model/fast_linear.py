"""Faster CPU execution of the Linear layers, swapped in after loading.

- `bf16`: the model's own bf16 weights: our AVX512-BF16 kernel (`native_kernels`) for decode and
  verification, where it builds, else pre-packed once into oneDNN's blocked layout (the plain bf16
  matmul re-packs on every call and runs at ~1/3 of memory bandwidth on these CPUs). Exact w.r.t.
  the bf16 model up to accumulation order.
- `int8`: weight-only int8 with per-channel scales (our AVX512 kernel, `native_kernels`, where it builds;
  else `torch._weight_int8pack_mm`).
- `int8-dynamic`: int8 weights x int8 activations quantized per token at run time (our VNNI kernel,
  else FBGEMM's int8 GEMM): the fastest verification forward (docs/kernels.md).
- `int4`: weight-only int4 with group-wise scales/minima (our AVX512 kernel, groups of 128; else
  `torch._weight_int4pack_mm_for_cpu`, groups of 32).
- `int4-hybrid`: int4 for forwards of a few tokens, bf16 for prefill (drafts).
The quantized formats change the model: for drafts (which never change the output) or
explicit opt-in.
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.config import QUANTIZATIONS
from specdecode.model import native_kernels

LinearFormat = Literal["none", "bf16", "int8", "int8-dynamic", "int4", "int4-hybrid", "gguf"]
FORMATS: tuple[str, ...] = ("none", "bf16", "int8", "int8-dynamic", "int4", "int4-hybrid")
"""Formats `convert_linears` converts nn.Linear layers into ("gguf" linears are built at load instead)."""


def _native(native: bool | None) -> bool:
    """Use our AVX512 kernels: where they build and the CPU has AVX512-BF16 and VNNI (None: if so)."""
    if native and not native_kernels.available():
        raise ValueError("the native CPU kernels are not available on this machine")
    return native_kernels.available() if native is None else native


@functools.cache
def onednn_bf16_supported() -> bool:
    """oneDNN's bf16 matmul runs here: it needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT, and refuses otherwise."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


@functools.cache
def bf16_uses_avx2_kernel() -> bool:
    """The bf16 format runs on our AVX2 kernel here (no AVX512 kernels, no oneDNN bf16 matmul): its weights are
    re-laid out into a copy, a tied output matrix included (counted by `engine.validation.estimate_bytes`)."""
    return not native_kernels.available() and not onednn_bf16_supported() and native_kernels.avx2_available()


def bf16_copies_weights() -> bool:
    """The bf16 format keeps its own re-laid-out copy of the weights here (the AVX2 or the AMX kernel), so a tied
    output matrix costs its bytes twice (`engine.validation.estimate_bytes`)."""
    return bf16_uses_avx2_kernel() or (native_kernels.available() and native_kernels.amx_available())


NATIVE_BF16_MAX_ROWS = 65
"""Rows up to which bf16 linears take our kernel: one token, or the verification of a chain or of a tree of
up to 64 nodes (specdecode.tree.MAX_TREE_NODES) plus its root. Longer forwards (prefill) go to torch: oneDNN,
or fp32 matmuls on chunks (`fp32_linear_by_chunks`) on AVX2-only CPUs. (The AMX kernel has no such limit.)"""


FP32_CHUNK_CHANNELS = 256
"""Output channels per fp32 copy in `fp32_linear_by_chunks`: 256 x 8960 fp32 weights (9 MB) stay in a
Zen 3's L3 between their conversion and their matmul."""


def fp32_linear_by_chunks(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
                          chunk: int = FP32_CHUNK_CHANNELS) -> torch.Tensor:
    """x [M, K] (rounded to bf16 first, as the kernels do) times the bf16 weights packed for the AVX2 kernel
    (`native_kernels.pack_bf16_avx2`: [groups, K, 16], N = n) + bias, in fp32 -> [M, N].

    Converting the whole weight to fp32 per call writes and re-reads twice its bytes in memory (~40% of a
    prefill's time on a 2-core AVX2 CPU); a chunk at a time converts into cache and multiplies from there."""
    xf = x.to(torch.bfloat16).float().t()  # [K, M]
    groups, k, width = packed.shape
    per = max(1, chunk // width)  # groups per chunk
    yt = torch.empty(groups * width, x.shape[0])  # [N rounded up to groups, M]
    buf = torch.empty(k * min(groups, per) * width)
    for g0 in range(0, groups, per):
        g1 = min(groups, g0 + per)
        w = native_kernels.unpack_bf16_avx2_to_f32(packed[g0:g1], buf[: k * (g1 - g0) * width].view(k, -1))
        torch.mm(w.t(), xf, out=yt[g0 * width : g1 * width])  # [chunk channels, M]
    yt = yt[:n]
    if bias is not None:
        yt += bias.float()[:, None]
    return yt.t().contiguous()


class BF16Linear(nn.Module):
    """The model's own bf16 weights: the exact target's format on CPU.

    With our kernels (`native`): they read the weights for one token ~1.3-1.5x faster than oneDNN's
    pre-packed ones, and a row's result does not depend on the other rows of the forward. Prefill goes
    to torch's bf16 matmul, which re-packs the weights per call: little next to a long prompt's
    arithmetic. Without them: oneDNN's weights pre-packed once (the plain bf16 matmul re-packs on every
    call and reads a single token at ~1/3 of memory bandwidth). On Intel CPUs with AMX, our AMX kernel takes
    every forward, prefill included (`native_kernels.bf16_gemm_amx`): a 16-row verification there costs ~1.2x
    one row, against ~3x on the AVX512 kernel, whose bf16 dot products are slow on those cores."""

    def __init__(self, linear: nn.Linear, native: bool | None = None, own: bool = False) -> None:
        """own: copy the weights even where they are bf16 already (a quantizing conversion frees what was loaded;
        a kept view would hold the whole weights file in memory)."""
        super().__init__()
        w = linear.weight.detach().to(torch.bfloat16)
        if own and w.data_ptr() == linear.weight.data_ptr():
            w = w.clone()
        self.out_features, self.in_features = w.shape
        self.native = _native(native)
        self.amx = self.native and native_kernels.amx_available()
        """Intel CPUs with AMX: our AMX kernel for every row count (prefill too), weights re-laid out."""
        self.avx2 = not self.native and bf16_uses_avx2_kernel()
        """A CPU without AVX512 (oneDNN's bf16 matmul refuses to run): our AVX2 kernel for a few rows,
        fp32 matmuls for prefill."""
        if self.amx:
            self.packed_amx = native_kernels.pack_bf16_amx(w)  # [N/64, K/32, 4, 16, 16, 2]; a copy (tied too)
        elif self.native:
            self.weight = w.contiguous()  # [N, K]
        elif self.avx2:
            self.packed_avx2 = native_kernels.pack_bf16_avx2(w)  # [N/16, K, 16]; a copy (of a tied lm_head too)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()  # own copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.native or self.avx2):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        shape = x.shape
        if self.amx:
            y = native_kernels.bf16_gemm_amx(x, self.packed_amx, self.out_features, self.bias)  # [M, N], x's dtype
            return y.reshape(*shape[:-1], y.shape[-1])
        if x.numel() // shape[-1] > NATIVE_BF16_MAX_ROWS:
            if self.avx2:  # torch's bf16 matmul has no fast path here: fp32 matmuls on chunks of the weights
                y = fp32_linear_by_chunks(x.reshape(-1, shape[-1]), self.packed_avx2, self.out_features, self.bias)
                return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)  # [..., N]
            return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)
        if self.avx2:
            y = native_kernels.bf16_gemm_avx2(x, self.packed_avx2, self.out_features, self.bias)  # [M, N], x's dtype
        else:
            y = native_kernels.bf16_gemm(x, self.weight, self.bias)
        return y.reshape(*shape[:-1], y.shape[-1])


class Int8WeightLinear(nn.Module):
    """int8 weights, one bf16 scale per output channel; activations stay floating point (rounded to bf16).

    All kernels take the same weights; ours (`native`, AVX512; `avx2`, AVX2 CPUs, weights re-laid out in
    groups of 16 channels) compute every row the same way whatever the number of rows, so verifying k tokens
    gives the rows of k single-token forwards bit for bit. torch's (`native=False`) reads one token's weights
    at about half the speed of the AVX2 kernel on a Zen 3."""

    def __init__(self, linear: nn.Linear, native: bool | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scales = (w.abs().amax(dim=1).clamp(min=1e-8) / 127.0).to(torch.bfloat16)  # [N]
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scales
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()  # own copy
        self.out_features, self.in_features = q.shape
        self.native = _native(native)
        self.avx2 = native is None and not self.native and native_kernels.avx2_int8_available()
        if self.native:
            self.tiles = native_kernels.tile_rows(q, native_kernels.INT8_TILE_ROWS)  # [N/4, K/64, 4, 64]
        elif self.avx2:
            self.packed_avx2 = native_kernels.pack_int8_avx2(q)  # [N/16, K, 16]
        else:
            self.weight = q  # [N, K]

    def dequantized(self) -> torch.Tensor:
        if self.native:
            q = native_kernels.untile_rows(self.tiles, self.out_features, self.in_features, torch.int8)
        elif self.avx2:
            q = native_kernels.unpack_int8_avx2(self.packed_avx2, self.out_features)
        else:
            q = self.weight
        return q.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.native:
            y = native_kernels.int8_gemm(x, self.tiles, self.scales)  # [M, N], fp32 or bf16 like x
        elif self.avx2:
            y = native_kernels.int8_gemm_avx2(x, self.packed_avx2, self.scales)  # [M, N], x's dtype
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

    Kernels: ours (`native`: AVX512-VNNI, the quantization inside the call; one token reads the weights
    ~1.5x faster than FBGEMM plus torch's per-token quantization ops), else FBGEMM's, which receives the
    integers with scale 1 and zero point qmax + 1.
    """

    def __init__(self, linear: nn.Linear, native: bool | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        # Scales rounded to bf16 numbers: q * scale is then exact in fp32 (dequantized() is the weight).
        scales = (w.abs().amax(dim=1).clamp(min=1e-8) / 127.0).to(torch.bfloat16).float()  # [N]
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.out_features, self.in_features = w.shape
        self.native = _native(native)
        if self.native:
            self.tiles = native_kernels.tile_rows(q)  # [N / 16, K / 64, 16, 64]
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
            q = native_kernels.untile_rows(self.tiles, self.out_features, self.in_features, torch.int8)
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
            y = native_kernels.int8_dynamic_gemm(x, self.tiles, self.out_features, self.weight_sums, self.scales,
                                                 self.bias, self.qmax)  # [M, N]
            return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)
        xq, scale = self.quantize_activations(x.reshape(-1, shape[-1]).float())
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(xq, 1.0, self.qmax + 1, self.packed)
        y = y * scale if self.bias is None else torch.addcmul(self.bias, y, scale)
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)


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
            native = k % native_kernels.INT4_GROUP == 0 and native_kernels.available()
        elif native and k % native_kernels.INT4_GROUP:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group size {native_kernels.INT4_GROUP}")
        self.native = _native(native)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()  # own copy
        if self.native:
            self._init_native(linear.weight.detach().float())
        else:
            self._init_torch(linear.weight.detach().float(), group_size, inner_k_tiles)

    def _init_native(self, w: torch.Tensor) -> None:
        n, k = w.shape
        group = native_kernels.INT4_GROUP
        groups = w.reshape(n, k // group, group)
        # Scale and minimum rounded to bf16 first, so q is chosen against the numbers the kernel uses.
        low = groups.amin(-1).to(torch.bfloat16)  # [N, G]
        scale = ((groups.amax(-1) - low.float()) / 15.0).clamp(min=1e-6).to(torch.bfloat16)  # [N, G]
        q = torch.round((groups - low.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
        self.group_size = group
        packed = native_kernels.pack_int4(q.to(torch.uint8).reshape(n, k))  # [N, K/2]
        self.packed = native_kernels.tile_rows(packed, native_kernels.INT4_TILE_ROWS)  # [N/4, K/128, 4, 64]
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
            q = native_kernels.unpack_int4(native_kernels.untile_rows(self.packed, n, k // 2, torch.uint8))
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
            y = native_kernels.int4_gemm(x, self.packed, self.scale, self.offset)  # [M, N]
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


_CONSTRUCTORS = {
    "bf16": BF16Linear,
    "int8": Int8WeightLinear,
    "int8-dynamic": Int8DynamicLinear,
    "int4": Int4WeightLinear,
    "int4-hybrid": Int4HybridLinear,
}


NATIVE_FORMATS: tuple[str, ...] = ("bf16", "int8", "int8-dynamic", "int4", "int4-hybrid")
"""Formats that run on our kernels or torch's (`native`)."""


def convert_linears(model: nn.Module, fmt: LinearFormat, native: bool | None = None) -> nn.Module:
    """Replace every nn.Linear (lm_head included) by the given CPU format, in place. `native` picks the
    kernels of a weight-only format (None: ours where available)."""
    if fmt in ("none", "gguf"):  # gguf: the linears were built from the file's blocks at load (gguf_model)
        return model
    if fmt not in _CONSTRUCTORS:
        raise ValueError(f"unknown linear format {fmt!r}; choose one of {', '.join(FORMATS)}")
    make = _CONSTRUCTORS[fmt]
    if native is not None and fmt in NATIVE_FORMATS:
        make = functools.partial(make, native=native)
    # Parents only: a list of every module would keep each replaced Linear (and its weights) alive until
    # the end, doubling the memory a conversion needs at its peak.
    parents = [m for m in model.modules() if any(isinstance(c, nn.Linear) for c in m.children())]
    for module in parents:
        for child_name in [n for n, c in module.named_children() if isinstance(c, nn.Linear)]:
            setattr(module, child_name, make(getattr(module, child_name)))
    if fmt != "bf16":  # bf16 keeps the loaded weights themselves (mapped from the file): nothing to free
        _own_remaining_parameters(model)
    return model


def _own_remaining_parameters(model: nn.Module) -> None:
    """Copy the parameters a quantizing conversion left in place (embeddings, norms) out of the weights file's
    memory map (the formats copy their own biases): while one loaded tensor lives, the whole file stays
    mapped and resident next to the new weights (3.1 GB more for the 1.5B target)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.device.type == "cpu":
                p.data = p.data.clone()


def target_linear_format(quantization: str, dtype: torch.dtype, device: torch.device) -> LinearFormat:
    """The target keeps its weights unless the user opts into quantization; on CPU in bf16 they run on
    the `bf16` format (same values, faster kernels)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if device.type != "cpu":
        if quantization != "none":
            raise ValueError(f"quantization {quantization!r} is implemented for CPU only")
        return "none"
    if quantization != "none":
        return quantization  # type: ignore[return-value]
    return "bf16" if dtype == torch.bfloat16 else "none"


def draft_linear_format(quantization: str, dtype: torch.dtype, device: torch.device) -> LinearFormat:
    """A draft never changes the output, so "auto" takes the fastest single-token path on this CPU:
    - AVX512-BF16 (our kernels): int4, with bf16 for its prefill (0.5B draft, one token: 52 ms packed bf16,
      23.2 ms torch's int4 kernel, 16.6 ms ours);
    - AVX2 only: weight-only int8 on our AVX2 kernel (one token of the 0.5B draft: 47-50 ms, against 59-70
      bf16, 66-80 int4-hybrid on torch's int4 kernel and 88 torch's int8; `benchmarks/decode_step.py`)."""
    if quantization == "auto":
        if device.type != "cpu" or dtype != torch.bfloat16:
            return "none"
        if not native_kernels.available() and native_kernels.avx2_int8_available():
            return "int8"
        return "int4-hybrid"
    if quantization == "int4-hybrid":
        if device.type != "cpu":
            raise ValueError("quantization 'int4-hybrid' is implemented for CPU only")
        return "int4-hybrid"
    return target_linear_format(quantization, dtype, device)
