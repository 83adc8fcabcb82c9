"""The GEMMs of the native kernel libraries (`native_kernels`): weight-only int8 and int4, int8 x int8 with
per-token activation scales, bf16 (AVX512, AMX and AVX2) and fp32, each on the weight layout of `native_layouts`.

Why hand-written kernels: for one token torch's weight-only kernels read weights well below the machine's read
bandwidth, and plain decoding is bound by that read (docs/kernels.md). These decode 64 bytes of weights at a
time with in-lane byte shuffles and shifts (int8 to fp32 for FMAs, int4 to bf16 for AVX512-BF16 dot products),
reuse each decoded block for every row of the input, and compute every output element as one accumulation
chain in a fixed order: a row's result does not depend on the other rows of the forward.
"""

from __future__ import annotations

import ctypes

import torch

from specdecode.model import native_kernels
from specdecode.model.native_kernels import amx_library, avx2_library, library
from specdecode.model.native_layouts import AVX2_GROUP, CHUNK_BYTES, INT4_TILE_ROWS, INT8_TILE_ROWS, TILE_ROWS


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous [M, K] fp32 or bf16 matrix (other dtypes go through fp32)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()
    return x2.contiguous()


def _gemm(kernel: str, x: torch.Tensor, *weights: torch.Tensor | None, scalars: tuple[float, ...] = (),
          n: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Call <kernel>_gemm(x, is_f32, M, K, *weights, *scalars, N, y, is_f32, threads): [M, N] in x's dtype
    (fp32, or bf16 for bf16 inputs). N is `n`, else the first weight's row count; a None weight is a NULL
    pointer. `lib`: the library holding the kernel (default: the AVX512 one)."""
    lib = lib or library()
    assert lib is not None
    x2 = _rows(x)
    m, k = x2.shape
    assert weights[0] is not None
    n = weights[0].shape[0] if n is None else n
    y = torch.empty(m, n, dtype=x2.dtype)
    f32 = int(x2.dtype == torch.float32)
    ptrs = (None if w is None else w.data_ptr() for w in weights)
    getattr(lib, f"{kernel}_gemm")(x2.data_ptr(), f32, m, k, *ptrs, *scalars, n, y.data_ptr(), f32,
                                   torch.get_num_threads())
    return y


def int8_gemm(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (fp32/bf16) times (q [N, K] int8 * scale [N] bf16).T -> [M, N] in x's dtype; q tiled by
    `tile_rows(q, INT8_TILE_ROWS)`."""
    assert tiles.dtype == torch.uint8 and tiles.shape[2] == INT8_TILE_ROWS and scale.dtype == torch.bfloat16
    return _gemm("woq_int8", x, tiles, scale, n=scale.shape[0])


def int4_gemm(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] times ((128 + q) * scale + offset).T with q packed by `pack_int4` and tiled by
    `tile_rows(packed, INT4_TILE_ROWS)`; scale, offset fp32 [N, K / 128]."""
    assert tiles.dtype == torch.uint8 and tiles.shape[2] == INT4_TILE_ROWS
    assert scale.dtype == offset.dtype == torch.float32
    return _gemm("woq_int4", x, tiles, scale, offset, n=scale.shape[0])


def _check_tiles(tiles: torch.Tensor, n: int, row_bytes: int) -> None:
    # The kernel trusts these sizes: a mismatch would read past the tiles.
    assert tiles.is_contiguous() and tiles.shape[2:] == (TILE_ROWS, CHUNK_BYTES)
    assert tiles.shape[0] == -(-n // TILE_ROWS) and tiles.shape[1] == -(-row_bytes // CHUNK_BYTES)


def int8_dynamic_gemm(x: torch.Tensor, tiles: torch.Tensor, n: int, wsum: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None, qmax: float) -> torch.Tensor:
    """x [M, K] (fp32/bf16), each row quantized to integers round(x / s), s = max|x| / qmax, times q [n, K]
    int8 (as `tile_rows(q)`; wsum = q.sum(1) int32): float(exact integer dot) * scale [n] fp32 * s (+ bias
    fp32) -> [M, n]."""
    assert tiles.dtype == torch.uint8 and wsum.dtype == torch.int32 and scale.dtype == torch.float32
    assert bias is None or bias.dtype == torch.float32
    _check_tiles(tiles, n, x.shape[-1])
    return _gemm("int8_dynamic", x, tiles, wsum, scale, bias, scalars=(qmax,), n=n)


def bf16_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16) times w.T (bf16 [N, K], contiguous) + bias (bf16 [N]) -> [M, N] in x's dtype;
    the bias is added in fp32 before the result is rounded."""
    assert w.dtype == torch.bfloat16 and w.is_contiguous() and (bias is None or bias.dtype == torch.bfloat16)
    return _gemm("bf16", x, w, bias)


def f32_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 times w.T (fp32 [N, K], contiguous) + bias (fp32 [N]) -> [M, N] fp32, each element one
    accumulation chain in a fixed order (torch's fp32 matmul rounds a row differently by the row count)."""
    lib = native_kernels.f32_library()
    assert lib is not None and w.dtype == torch.float32 and w.is_contiguous()
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    m, k = x2.shape
    n = w.shape[0]
    assert w.shape[1] == k
    y = torch.empty(m, n)
    lib.f32_gemm(x2.data_ptr(), m, k, w.data_ptr(), None if bias is None else bias.data_ptr(), n, y.data_ptr(),
                 torch.get_num_threads())
    return y


def bf16_gemm_amx(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16) times the packed weights' w.T + bias (bf16 [N]) -> [M, N] in x's dtype, on AMX
    tiles: any M, each row's result independent of the others; the bias is added in fp32 before rounding.
    Weights packed by `pack_bf16_amx`."""
    assert packed.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)
    return _gemm("amx_bf16", x, packed, bias, n=n, lib=amx_library())


def bf16_gemm_avx2(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`bf16_gemm` for AVX2 CPUs (`avx2_available()`) on weights packed by `pack_bf16_avx2` (N = n): same
    contract, same values up to summation order."""
    assert packed.dtype == torch.bfloat16 and packed.is_contiguous() and packed.shape[2] == AVX2_GROUP
    assert bias is None or bias.dtype == torch.bfloat16
    return _gemm("bf16", x, packed, bias, n=n, lib=avx2_library())


def int8_gemm_avx2(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_gemm` for AVX2 CPUs on weights packed by `pack_int8_avx2` (N = scale's length): (x q^T) * scale
    [M, N] in x's dtype; a row's result does not depend on the other rows."""
    assert packed.dtype == torch.int8 and packed.is_contiguous() and packed.shape[2] == AVX2_GROUP
    assert scale.dtype == torch.bfloat16
    return _gemm("int8", x, packed, scale, n=scale.shape[0], lib=avx2_library())
