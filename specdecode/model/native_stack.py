"""The decoder layers of a decode or verification forward in one native call (`decode_layers` in
kernels/cpu_kernels.c).

Module by module, a decode step of the 1.5B target on 2 cores spends ~7 ms a token between the native
kernels, in Python and torch glue (wrappers, views, empty outputs, residual adds): ~13% of an int8-dynamic
step. `decode_layers` makes the same kernel calls in the same order and rounds the residual adds as torch
does, so the output is the module-by-module forward's bit for bit (tests/test_native_stack.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from specdecode.model import native_kernels
from specdecode.model.bf16_linear import BF16Linear
from specdecode.model.gguf_linear import GGUFLinear
from specdecode.model.gguf_linear import gemm_address as gguf_gemm_address
from specdecode.model.int4_linear import Int4HybridLinear, Int4WeightLinear
from specdecode.model.int8_linear import Int8DynamicLinear, Int8WeightLinear
from specdecode.model.kv_cache import CacheSlots, KVCache

LIN_BF16, LIN_INT8_DYNAMIC, LIN_WOQ_INT8, LIN_WOQ_INT4, LIN_GEMM_FN = 0, 1, 2, 3, 4


class LinearEntry(ctypes.Structure):
    """cpu_kernels.c's `linear_t`."""

    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("qmax", ctypes.c_double)]


class LayerEntry(ctypes.Structure):
    """cpu_kernels.c's `layer_t`."""

    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("qkv", LinearEntry), ("o", LinearEntry),
                ("gate_up", LinearEntry), ("down", LinearEntry)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear_entry(module: nn.Module) -> tuple[LinearEntry, int] | None:
    """A linear layer as the kernel's description and the most rows it takes there; None if the module is
    not one of our native linears."""
    rows = 1 << 30
    if isinstance(module, Int4HybridLinear):  # its int4 half serves forwards of up to max_int4_rows rows
        module, rows = module.int4, module.max_int4_rows
    if isinstance(module, BF16Linear) and module.avx2:  # below AVX512-BF16: the AVX2 library's bf16 GEMM
        entry = LinearEntry(LIN_GEMM_FN, module.out_features, module.in_features, _ptr(module.packed_avx2),
                            native_kernels.avx2_bf16_gemm_address(), None, _ptr(module.bias), 0.0)
        return entry, rows
    if not getattr(module, "native", False):
        return None
    if isinstance(module, GGUFLinear):  # GGUF blocks: gguf_gemm adds the bias itself
        entry = LinearEntry(LIN_GEMM_FN, module.out_features, module.in_features, ctypes.addressof(module.desc),
                            gguf_gemm_address(module.kernel), None, _ptr(module.bias), 0.0)
        return entry, rows
    if isinstance(module, BF16Linear) and module.amx:  # any row count
        entry = LinearEntry(LIN_GEMM_FN, module.out_features, module.in_features, _ptr(module.packed_amx),
                            native_kernels.amx_gemm_address(), None, _ptr(module.bias), 0.0)
        return entry, rows
    if isinstance(module, BF16Linear):
        entry = LinearEntry(LIN_BF16, module.out_features, module.in_features, _ptr(module.weight), None, None,
                            _ptr(module.bias), 0.0)
        return entry, rows
    if isinstance(module, Int8DynamicLinear):
        entry = LinearEntry(LIN_INT8_DYNAMIC, module.out_features, module.in_features, _ptr(module.tiles),
                            _ptr(module.weight_sums), _ptr(module.scales), _ptr(module.bias), float(module.qmax))
        return entry, rows
    if isinstance(module, Int8WeightLinear):
        entry = LinearEntry(LIN_WOQ_INT8, module.out_features, module.in_features, _ptr(module.tiles),
                            _ptr(module.scales), None, _ptr(module.bias), 0.0)
        return entry, rows
    if isinstance(module, Int4WeightLinear):
        n, k = module.out_features, module.in_features
        entry = LinearEntry(LIN_WOQ_INT4, n, k, _ptr(module.packed), _ptr(module.scale), _ptr(module.offset),
                            _ptr(module.bias), 0.0)
        return entry, rows
    return None


@dataclass
class NativeStack:
    """A model's layers as `decode_layers` reads them. The entries point into the modules' tensors, which
    `modules` keeps alive."""

    layers: ctypes.Array
    modules: list[nn.Module]
    max_rows: int
    eps: float


def build(model: nn.Module) -> NativeStack | None:
    """The stack of a `Transformer` with fused projections, bf16 norms and native linears; else None, as for
    layers the kernel does not compute (q/k norms, Gemma's norms, GeGLU, soft-capping: `plain_layers`)."""
    if not model.config.plain_layers:
        return None
    layers = list(model.model.layers)
    only_gemm_fn = not native_kernels.available()  # the AVX2 library's stack calls GEMM functions only
    entries, modules, max_rows = [], [], 1 << 30
    eps = {float(layer.input_layernorm.eps) for layer in layers} | {float(layer.post_attention_layernorm.eps)
                                                                    for layer in layers}
    if len(eps) != 1:
        return None
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None or mlp.gate_up_proj is None:
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.bfloat16 or not w.is_contiguous() for w in norms):
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        described = [linear_entry(m) for m in linears]
        if any(d is None for d in described) or (only_gemm_fn and any(e.kind != LIN_GEMM_FN for e, _ in described)):
            return None
        max_rows = min(max_rows, *(rows for _, rows in described))
        entries.append(LayerEntry(norms[0].data_ptr(), norms[1].data_ptr(), *(e for e, _ in described)))
        modules += [layer, *linears]
    array = (LayerEntry * len(entries))(*entries)
    return NativeStack(array, modules, max_rows, eps.pop())


def _ends(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The first and last linear of the layers: a conversion replaces both."""
    layers = model.model.layers
    return layers[0].self_attn.qkv_proj, layers[-1].mlp.down_proj


def set_enabled(model: nn.Module, enabled: bool) -> None:
    """Let the model's next few-row forwards take the stack (the default), or keep them module by module until
    its linears are converted again (A/B benchmarks, tests)."""
    model._native_stack = None if enabled else (*_ends(model), None)


def cache_fits(cache: KVCache) -> bool:
    """K and V [L, B, KVH, S, hd] with the same strides and each slot's hd numbers contiguous: the kernel's
    addressing (a batch engine's row views of a larger cache qualify)."""
    k, v = cache.k, cache.v
    return k.stride() == v.stride() and k.stride()[3:] == (k.shape[4], 1)


def stack_for(model: nn.Module, x: torch.Tensor, cache: KVCache | None) -> NativeStack | None:
    """The model's stack if this forward (x [B, T, D]) can take it: bf16 inference on CPU with our kernels,
    a bf16 cache, and linears that all have a native path for B * T rows. The caller keeps T within the
    attention kernel's few queries."""
    b, t, _ = x.shape
    if cache is None or cache.k.dtype != torch.bfloat16 or not native_kernels.attend_applies(x, model.config.head_dim):
        return None
    if not cache_fits(cache):
        return None
    first, last = _ends(model)
    built = model._native_stack
    if built is None or built[0] is not first or built[1] is not last:  # new, or its linears were converted
        built = model._native_stack = (first, last, build(model))
    stack = built[2]
    if stack is None or b * t > stack.max_rows:
        return None
    return stack


def run(
    model: nn.Module,
    stack: NativeStack,
    x: torch.Tensor,  # [B, T, D] bf16, contiguous: updated in place
    cos: torch.Tensor,  # [B, 1, T, hd] bf16
    sin: torch.Tensor,
    slots: CacheSlots,
    kv_len: int,
    mask: torch.Tensor | None,  # [B, 1, T, S] bool
    cache: KVCache,
    capture: tuple[int, ...] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x after every decoder layer (before the final norm), K/V written at the slots; and a copy of x as it
    enters each layer in `capture` (ascending; the layer count = after the last), one native call per stretch
    between them."""
    lib = native_kernels.glue_library()
    assert lib is not None and x.is_contiguous() and x.dtype == torch.bfloat16
    cfg = model.config
    b, t, d = x.shape
    assert slots.end <= cache.max_len and cache_fits(cache)
    cos, sin = cos.contiguous(), sin.contiguous()
    index = slots.index.to(torch.int64).contiguous()
    m = None if mask is None else mask.expand(b, 1, t, kv_len).contiguous()
    inter = stack.layers[0].down.k
    ls, sb, sh = cache.k.stride(0), cache.k.stride(1), cache.k.stride(2)
    kv_bytes = ls * cache.k.element_size()  # one layer's K (or V) cache
    kept: list[torch.Tensor] = []
    start = 0
    for end in (*capture, len(stack.layers)):
        if end > start:  # layers [start, end): their entries and caches begin `start` layers in
            lib.decode_layers(x.data_ptr(), b, t, d, ctypes.addressof(stack.layers) + start * ctypes.sizeof(LayerEntry),
                              end - start, stack.eps, cos.data_ptr(), sin.data_ptr(), index.data_ptr(), cfg.num_heads,
                              cfg.num_kv_heads, cfg.head_dim, inter, cache.k.data_ptr() + start * kv_bytes,
                              cache.v.data_ptr() + start * kv_bytes, ls, sb, sh, kv_len, _ptr(m),
                              cfg.head_dim**-0.5, torch.get_num_threads())
            start = end
        if len(kept) < len(capture):
            kept.append(x.clone())  # x is updated in place by the next stretch
    return x, kept
