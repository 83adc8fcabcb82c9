"""The C kernel libraries of kernels/, built on first use and loaded through ctypes, and the decoder ops they
share: RMSNorm, rope with the KV-cache write and SiLU·up for bf16 forwards, and attention (bf16 or fp32, each
query over the slots it sees, at any length).

Three libraries: cpu_kernels.c (AVX512-BF16 and VNNI: the GEMMs of every format and of fp32, the decoder ops and
the native layer stack), cpu_kernels_amx.c (the bf16 GEMM on AMX tiles) and cpu_kernels_avx2.c (for CPUs without
AVX512-BF16: the bf16, weight-only int8 and fp32 GEMMs, the attention, the decoder ops and the stack). They need a
C compiler with OpenMP; each checks the CPU's features before any kernel runs, and where it does not build or the
CPU lacks them (or with SPECDECODE_NATIVE_KERNELS=0) its check (`available()`, `amx_available()`,
`avx2_available()`) is False and the model keeps torch's kernels. The GEMMs' Python side is `native_gemm`, the
weight layouts they read `native_layouts`.

Each decoder op replaces a handful of small torch ops with one call doing the same arithmetic in fp32: in a
forward of a few tokens the Python and torch glue between those ops, not their arithmetic, is what costs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from pathlib import Path

import torch

from specdecode import cpu_isa
from specdecode.model.native_layouts import AVX2_GROUP

SOURCE = Path(__file__).with_name("kernels") / "cpu_kernels.c"
SOURCE_AMX = Path(__file__).with_name("kernels") / "cpu_kernels_amx.c"
"""The bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later): every row count at about one row's cost."""
SOURCE_AVX2 = Path(__file__).with_name("kernels") / "cpu_kernels_avx2.c"
"""The bf16 GEMM for CPUs with AVX2 but without AVX512-BF16, where neither the kernels above nor oneDNN's
bf16 matmul run (`native_gemm.bf16_gemm_avx2`)."""
FLAGS = ["-O3", "-fopenmp"]
"""No -march=native: the AVX512 functions carry their own target attribute, and the library checks the CPU."""

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


def _load(source: Path, name: str, supported: str) -> ctypes.CDLL | None:
    """The library built from `source`, if the build works and its `supported()` check passes on this CPU."""
    if os.environ.get("SPECDECODE_NATIVE_KERNELS", "1") == "0":
        return None
    from specdecode.native_build import BuildError, build_shared

    try:
        path = build_shared(source.read_text(), name, FLAGS)
    except BuildError as exc:
        warnings.warn(f"native CPU kernels not built, using torch's: {exc}", stacklevel=4)
        return None
    lib = ctypes.CDLL(str(path))  # libgomp.so.1 resolves to the copy torch already loaded: one thread pool
    return lib if getattr(lib, supported)() else None


def library() -> ctypes.CDLL | None:
    """The AVX512 library (cpu_kernels.c), or None where it does not build or run (or SPECDECODE_ISA is below
    `avx512bf16`)."""
    return _avx512_library() if cpu_isa.allows("avx512bf16") else None


@functools.cache
def _avx512_library() -> ctypes.CDLL | None:
    lib = _load(SOURCE, "cpu-kernels", "cpu_supported")
    if lib is None:
        return None
    lib.woq_int8_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
    lib.woq_int8_gemm.restype = None
    lib.woq_int4_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _P, _L, _P, _I, _I]
    lib.woq_int4_gemm.restype = None
    lib.bf16_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
    lib.bf16_gemm.restype = None
    lib.f32_gemm.argtypes = [_P, _L, _L, _P, _P, _L, _P, _I]
    lib.f32_gemm.restype = None
    lib.int8_dynamic_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _P, _P, ctypes.c_float, _L, _P, _I, _I]
    lib.int8_dynamic_gemm.restype = None
    _attention_types(lib)
    _glue_types(lib)
    return lib


def available() -> bool:
    """The AVX512 library builds and runs here."""
    return library() is not None


def _glue_types(lib: ctypes.CDLL) -> None:
    """The decoder ops and the layer stack (both libraries have them)."""
    lib.rms_norm_bf16.argtypes = [_P, _P, ctypes.c_float, _L, _L, _P]
    lib.rms_norm_bf16.restype = None
    lib.rope_qkv_bf16.argtypes = [_P, _P, _P, _P, _L, _L, _L, _L, _L, _P, _P, _P, _L, _L]
    lib.rope_qkv_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [_P, _L, _L, _P]
    lib.silu_mul_bf16.restype = None
    lib.decode_layers.argtypes = [_P, _L, _L, _L, _P, _L, ctypes.c_float, _P, _P, _P, _L, _L, _L, _L, _P, _P, _L, _L,
                                  _L, _L, _P, ctypes.c_float, _I]
    lib.decode_layers.restype = None


def _attention_types(lib: ctypes.CDLL) -> None:
    lib.attend_bf16.argtypes = [_P, _P, _P, _P, _L, _L, _L, _L, _L, _L, _L, _L, ctypes.c_float, _P, _I]
    lib.attend_bf16.restype = None
    lib.attend_f32.argtypes = lib.attend_bf16.argtypes
    lib.attend_f32.restype = None


def _avx512_else_avx2(symbol: str) -> ctypes.CDLL | None:
    """The AVX512 library where it runs, else the AVX2 one if it has `symbol` (the same contract)."""
    lib = library()
    if lib is not None:
        return lib
    lib = avx2_library()
    return lib if lib is not None and hasattr(lib, symbol) else None


def f32_library() -> ctypes.CDLL | None:
    """The library whose `f32_gemm` runs here."""
    return _avx512_else_avx2("f32_gemm")


def glue_library() -> ctypes.CDLL | None:
    """The library whose attention, decoder ops and layer stack run here (the AVX2 one's stack takes only
    GEMM-function linears: `native_stack`)."""
    return _avx512_else_avx2("decode_layers")


def load_avx2_library(source: Path = SOURCE_AVX2, name: str = "cpu-kernels-avx2") -> ctypes.CDLL | None:
    """The AVX2 library built from `source` (another version of it for an A/B: benchmarks/kernels/avx2_rows.py)."""
    lib = _load(source, name, "avx2_supported")
    if lib is not None and hasattr(lib, "bf16_pack_group"):
        assert lib.bf16_pack_group() == AVX2_GROUP
    if lib is not None:
        lib.bf16_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
        lib.bf16_gemm.restype = None
    if lib is not None and hasattr(lib, "attend_bf16"):
        _attention_types(lib)
    if lib is not None and hasattr(lib, "decode_layers"):
        _glue_types(lib)
    if lib is not None and hasattr(lib, "f32_gemm"):
        lib.f32_gemm.argtypes = [_P, _L, _L, _P, _P, _L, _P, _I]
        lib.f32_gemm.restype = None
    if lib is not None and hasattr(lib, "int8_gemm"):
        lib.int8_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
        lib.int8_gemm.restype = None
    return lib


@functools.cache
def avx2_library() -> ctypes.CDLL | None:
    """The AVX2 library (cpu_kernels_avx2.c), or None."""
    return load_avx2_library()


def avx2_available() -> bool:
    """The AVX2 bf16 GEMM builds and runs here (any x86 CPU since Haswell / Zen)."""
    return avx2_library() is not None


def avx2_int8_available() -> bool:
    """The AVX2 library has the weight-only int8 GEMM too."""
    lib = avx2_library()
    return lib is not None and hasattr(lib, "int8_gemm")


def amx_library() -> ctypes.CDLL | None:
    """The AMX library (cpu_kernels_amx.c), or None (also with SPECDECODE_AMX=0, or SPECDECODE_ISA below `amx`)."""
    if os.environ.get("SPECDECODE_AMX", "1") == "0" or not cpu_isa.allows("amx"):
        return None
    return _amx_library()


@functools.cache
def _amx_library() -> ctypes.CDLL | None:
    lib = _load(SOURCE_AMX, "cpu-kernels-amx", "amx_supported")
    if lib is not None:
        lib.amx_bf16_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
        lib.amx_bf16_gemm.restype = None
    return lib


def amx_available() -> bool:
    """bf16 linears take the AMX kernel here: the CPU has AMX-BF16 and the kernel builds (SPECDECODE_AMX=0
    turns it off)."""
    return amx_library() is not None


def avx2_bf16_gemm_address() -> int:
    """Address of the AVX2 library's bf16 GEMM, for the native decoder stack's linear entries."""
    lib = avx2_library()
    assert lib is not None
    return ctypes.cast(lib.bf16_gemm, ctypes.c_void_p).value or 0


def amx_gemm_address() -> int:
    """Address of the AMX kernel's C function, for the native decoder stack's linear entries."""
    lib = amx_library()
    assert lib is not None
    return ctypes.cast(lib.amx_bf16_gemm, ctypes.c_void_p).value or 0


def use_native(native: bool | None) -> bool:
    """Whether a linear takes our AVX512 kernels: where they build and the CPU has AVX512-BF16 and VNNI (None:
    if so; True where they are missing is an error)."""
    if native and not available():
        raise ValueError("the native CPU kernels are not available on this machine")
    return available() if native is None else native


def glue_applies(x: torch.Tensor) -> bool:
    """Whether the RMSNorm / attention kernels take this bf16 CPU inference tensor (never under autograd:
    a head in training keeps torch's ops)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and glue_library() is not None)


def attend_applies(x: torch.Tensor, hd: int) -> bool:
    """Whether `attend` takes the queries of x (a layer's input or its queries): bf16 or fp32 inference on the
    CPU with our AVX512 or AVX2 kernels, and a head size hd the kernel's registers hold (a multiple of 16, at
    most 256)."""
    return (hd % 16 == 0 and hd <= 256 and x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"
            and not torch.is_grad_enabled() and glue_library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * bf16(x * rsqrt(mean(x^2) + eps)) over the last dim; x, weight bf16."""
    lib = glue_library()
    assert lib is not None and weight.dtype == torch.bfloat16
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(x2)
    w = weight.contiguous()
    lib.rms_norm_bf16(x2.data_ptr(), w.data_ptr(), eps, x2.shape[0], x2.shape[1], y.data_ptr())
    return y.view(x.shape)


def attend(
    q: torch.Tensor,  # [B, H, T, hd] bf16, roped
    keys: torch.Tensor,  # [B, KVH, S, hd] bf16 view of the cache (rows of hd contiguous)
    values: torch.Tensor,  # [B, KVH, S, hd], same strides as keys
    mask: torch.Tensor | None,  # [B, 1, T, S] bool, True = attend; None = every slot
    scale: float,
) -> torch.Tensor:
    """Softmax attention, each query over the slots it sees in slot order, fp32 inside: [B, T, H * hd] in q's
    dtype (o_proj's input layout). q, keys and values all bf16 or all fp32."""
    lib = glue_library()
    assert lib is not None
    b, h, t, hd = q.shape
    kvh, s = keys.shape[1], keys.shape[2]
    assert hd % 16 == 0 and hd <= 256 and keys.stride()[2:] == (hd, 1) and keys.stride() == values.stride()
    assert q.dtype == keys.dtype == values.dtype and q.dtype in (torch.bfloat16, torch.float32)
    qc = q.contiguous()
    m = None if mask is None else mask.expand(b, 1, t, s).contiguous()
    out = torch.empty(b, t, h * hd, dtype=q.dtype)
    kernel = lib.attend_f32 if q.dtype == torch.float32 else lib.attend_bf16
    kernel(qc.data_ptr(), keys.data_ptr(), values.data_ptr(), None if m is None else m.data_ptr(),
           b, h, kvh, t, s, hd, keys.stride(0), keys.stride(1), scale, out.data_ptr(), torch.get_num_threads())
    return out


def rope_qkv(
    qkv: torch.Tensor,  # [B, T, (H + 2 * KVH) * hd] bf16: the fused projection's output
    cos: torch.Tensor,  # [B, 1, T, hd] bf16 (`transformer.attention_inputs`)
    sin: torch.Tensor,  # [B, 1, T, hd] bf16, sign-folded
    slots: torch.Tensor,  # [B, T] cache slots
    slots_end: int,  # 1 + the highest slot
    k_cache: torch.Tensor,  # [B, KVH, S, hd] bf16: one layer of the cache, written in place
    v_cache: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Rope q and k as `transformer.apply_rope` does (same bits), store k and v at their slots: the roped
    queries [B, H, T, hd]. One call instead of ~20 small torch ops a layer."""
    lib = glue_library()
    assert lib is not None
    b, t, width = qkv.shape
    kvh, hd = k_cache.shape[1], k_cache.shape[3]
    assert width == (heads + 2 * kvh) * hd and k_cache.stride() == v_cache.stride() and k_cache.stride()[2:] == (hd, 1)
    assert slots_end <= k_cache.shape[2]  # the kernel writes where it is told
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    index = slots.to(torch.int64).contiguous()
    q = torch.empty(b, heads, t, hd, dtype=torch.bfloat16)
    lib.rope_qkv_bf16(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), index.data_ptr(), b, t, heads, kvh, hd,
                      q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1))
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up in bf16 for gate_up [..., 2 * I] bf16 (gate first) -> [..., I]."""
    lib = glue_library()
    assert lib is not None and gate_up.dtype == torch.bfloat16
    x = gate_up.contiguous()
    i = x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], i, dtype=torch.bfloat16)
    lib.silu_mul_bf16(x.data_ptr(), x.numel() // (2 * i), i, y.data_ptr())
    return y
