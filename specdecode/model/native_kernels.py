"""The kernels of kernels/cpu_kernels.c, built on first use and called through ctypes: GEMMs for a few rows
(weight-only int8 / int4, and bf16), and RMSNorm and attention for bf16 decode / verification forwards.

Why a hand-written kernel: torch's weight-only kernels read int8 weights at 18.6-20.8 GB/s and int4
at 19.3-21.6 GB/s on this 2-core CPU for one token (`benchmarks/linear_kernels.py`), well below what
plain decoding within 1.3x of its memory floor needs (~27 GB/s). The kernels decode 64 bytes of weights
at a time with in-lane byte shuffles and shifts (int8 to fp32 for FMAs, int4 to bf16 for AVX512-BF16 dot
products) and reuse each decoded block for every row of the input. The bf16 kernel streams the model's
own weights for one token at 40-50 GB/s where oneDNN's pre-packed ones read at 27-31 (more rows in
flight). They need a C compiler with OpenMP and an AVX512-BF16 CPU; elsewhere (or with
SPECDECODE_NATIVE_KERNELS=0) `available()` is False and the model keeps torch's kernels.

RMSNorm and attention of a few queries are a handful of small torch ops each (~12 ms a token of the
1.5B target on 2 cores, outside its linears); here each is one call doing the same arithmetic in fp32.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels") / "cpu_kernels.c"
SOURCE_AMX = Path(__file__).with_name("kernels") / "cpu_kernels_amx.c"
"""The bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later): every row count at about one row's cost."""
SOURCE_AVX2 = Path(__file__).with_name("kernels") / "cpu_kernels_avx2.c"
"""The bf16 GEMM for CPUs with AVX2 but without AVX512-BF16, where neither the kernels above nor oneDNN's
bf16 matmul run (`bf16_gemm_avx2`)."""
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


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = _load(SOURCE, "cpu-kernels", "cpu_supported")
    if lib is None:
        return None
    lib.woq_int8_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
    lib.woq_int8_gemm.restype = None
    lib.woq_int4_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _P, _L, _P, _I, _I]
    lib.woq_int4_gemm.restype = None
    lib.bf16_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
    lib.bf16_gemm.restype = None
    lib.int8_dynamic_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _P, _P, ctypes.c_float, _L, _P, _I, _I]
    lib.int8_dynamic_gemm.restype = None
    lib.rms_norm_bf16.argtypes = [_P, _P, ctypes.c_float, _L, _L, _P]
    lib.rms_norm_bf16.restype = None
    lib.attend_bf16.argtypes = [_P, _P, _P, _P, _L, _L, _L, _L, _L, _L, _L, _L, ctypes.c_float, _P, _I]
    lib.attend_bf16.restype = None
    lib.rope_qkv_bf16.argtypes = [_P, _P, _P, _P, _L, _L, _L, _L, _L, _P, _P, _P, _L, _L]
    lib.rope_qkv_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [_P, _L, _L, _P]
    lib.silu_mul_bf16.restype = None
    lib.decode_layers.argtypes = [_P, _L, _L, _L, _P, _L, ctypes.c_float, _P, _P, _P, _L, _L, _L, _L, _P, _P, _L, _L,
                                  _L, _L, _P, ctypes.c_float, _I]
    lib.decode_layers.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def load_avx2_library(source: Path = SOURCE_AVX2, name: str = "cpu-kernels-avx2") -> ctypes.CDLL | None:
    """The AVX2 library built from `source` (another version of it for an A/B: benchmarks/avx2_rows.py)."""
    lib = _load(source, name, "avx2_supported")
    if lib is not None and hasattr(lib, "bf16_pack_group"):
        assert lib.bf16_pack_group() == AVX2_GROUP
    if lib is not None:
        lib.bf16_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
        lib.bf16_gemm.restype = None
    if lib is not None and hasattr(lib, "bf16_unpack_f32"):
        lib.bf16_unpack_f32.argtypes = [_P, _L, _L, _P, _I]
        lib.bf16_unpack_f32.restype = None
    if lib is not None and hasattr(lib, "int8_gemm"):
        lib.int8_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
        lib.int8_gemm.restype = None
    return lib


@functools.cache
def _avx2_library() -> ctypes.CDLL | None:
    return load_avx2_library()


def avx2_available() -> bool:
    """The AVX2 bf16 GEMM builds and runs here (any x86 CPU since Haswell / Zen)."""
    return _avx2_library() is not None


def avx2_int8_available() -> bool:
    """The AVX2 library has the weight-only int8 GEMM too."""
    lib = _avx2_library()
    return lib is not None and hasattr(lib, "int8_gemm")


@functools.cache
def _amx_library() -> ctypes.CDLL | None:
    if os.environ.get("SPECDECODE_AMX", "1") == "0":
        return None
    lib = _load(SOURCE_AMX, "cpu-kernels-amx", "amx_supported")
    if lib is not None:
        lib.amx_bf16_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
        lib.amx_bf16_gemm.restype = None
    return lib


def amx_available() -> bool:
    """bf16 linears take the AMX kernel here: the CPU has AMX-BF16 and the kernel builds (SPECDECODE_AMX=0
    turns it off)."""
    return _amx_library() is not None


AMX_COLS, AMX_KSTEP = 64, 32
"""Output channels per group and k per tile step of the AMX kernel's packed weights."""


def pack_bf16_amx(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] bf16 -> the AMX kernel's layout [ceil(N / 64), ceil(K / 32), 4, 16, 16, 2] (zero-padded):
    element [g, s, t, p, n, j] = w[64 g + 16 t + n, 32 s + 2 p + j]."""
    n, k = w.shape
    groups, steps = -(-n // AMX_COLS), -(-k // AMX_KSTEP)
    padded = torch.nn.functional.pad(w.to(torch.bfloat16), (0, steps * AMX_KSTEP - k, 0, groups * AMX_COLS - n))
    out = _huge_page_bytes(padded.numel() * 2).view(torch.bfloat16).view(groups, steps, 4, 16, 16, 2)
    out.copy_(padded.view(groups, 4, 16, steps, 16, 2).permute(0, 3, 1, 4, 2, 5))
    return out


def unpack_bf16_amx(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack_bf16_amx`: a new [n, k] bf16 tensor."""
    groups, steps = packed.shape[:2]
    return packed.permute(0, 2, 4, 1, 3, 5).reshape(groups * AMX_COLS, steps * AMX_KSTEP)[:n, :k].contiguous()


def bf16_gemm_amx(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16) times the packed weights' w.T + bias (bf16 [N]) -> [M, N] in x's dtype, on AMX
    tiles: any M, each row's result independent of the others; the bias is added in fp32 before rounding."""
    assert packed.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)
    return _gemm("amx_bf16", x, packed, bias, n=n, lib=_amx_library())


def amx_gemm_address() -> int:
    """Address of the AMX kernel's C function, for the native decoder stack's linear entries."""
    lib = _amx_library()
    assert lib is not None
    return ctypes.cast(lib.amx_bf16_gemm, ctypes.c_void_p).value or 0


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
    lib = lib or _library()
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


INT8_TILE_ROWS = 4
"""Output channels of a weight-only int8 tile: the kernel's block (NR8 in cpu_kernels.c)."""


def int8_gemm(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (fp32/bf16) times (q [N, K] int8 * scale [N] bf16).T -> [M, N] in x's dtype; q tiled by
    `tile_rows(q, INT8_TILE_ROWS)`."""
    assert tiles.dtype == torch.uint8 and tiles.shape[2] == INT8_TILE_ROWS and scale.dtype == torch.bfloat16
    return _gemm("woq_int8", x, tiles, scale, n=scale.shape[0])


INT4_GROUP = 128
"""Input channels per int4 group: one 64-byte chunk of packed weights, one scale and minimum."""


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> [N, K / 2] bytes: in each group of 128, 16-bit word i (little-endian) holds
    q[i], q[i + 32], q[i + 64], q[i + 96] from its lowest nibble up."""
    n, k = q.shape
    quarters = q.to(torch.int32).reshape(n, k // 128, 4, 32)  # [N, G, nibble, word]
    words = quarters[:, :, 0] | quarters[:, :, 1] << 4 | quarters[:, :, 2] << 8 | quarters[:, :, 3] << 12
    lo, hi = (words & 0xFF).to(torch.uint8), (words >> 8).to(torch.uint8)  # [N, G, 32] each
    return torch.stack([lo, hi], dim=-1).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [N, K / 2] bytes -> q [N, K] (uint8)."""
    n, half = packed.shape
    b = packed.to(torch.int32).reshape(n, half // 64, 32, 2)  # [N, G, word, byte]
    words = b[..., 0] | b[..., 1] << 8  # [N, G, 32]
    quarters = torch.stack([(words >> 4 * j) & 0xF for j in range(4)], dim=2)  # [N, G, nibble, word]
    return quarters.reshape(n, half * 2).to(torch.uint8)


INT4_TILE_ROWS = 4
"""Output channels of an int4 tile: the kernel's block (NR4 in cpu_kernels.c). One sequential stream per
thread instead of four row streams: a decode step of the int4 1.5B target 42-44 ms against 46-53 on the
Intel Xeon (AMX) VMs (docs/kernels.md)."""


def int4_gemm(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] times ((128 + q) * scale + offset).T with q packed by `pack_int4` and tiled by
    `tile_rows(packed, INT4_TILE_ROWS)`; scale, offset fp32 [N, K / 128]."""
    assert tiles.dtype == torch.uint8 and tiles.shape[2] == INT4_TILE_ROWS
    assert scale.dtype == offset.dtype == torch.float32
    return _gemm("woq_int4", x, tiles, scale, offset, n=scale.shape[0])


TILE_ROWS, CHUNK_BYTES = 16, 64
"""The tiled layout of the int8 x int8 kernel's weights (see `tile_rows`)."""

_HUGE_PAGE = 2 << 20


def _huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of `nbytes`, in memory advised for transparent huge pages when large:
    weights streamed every token then cost fewer TLB misses (a few % of read speed here)."""
    if nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = -address % _HUGE_PAGE  # start on a huge-page boundary
    buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % _HUGE_PAGE)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)  # keeps `buf` alive


def tile_rows(w: torch.Tensor, rows_per_tile: int = TILE_ROWS) -> torch.Tensor:
    """w [N, K] (any dtype) as the kernels' tiles: uint8 [ceil(N / R), C, R, 64], C = ceil(K bytes / 64),
    R = `rows_per_tile` (16 for int8 x int8, `INT4_TILE_ROWS` for int4).

    Rows in blocks of R, each row cut into 64-byte chunks, chunk c of a block's R rows stored together,
    zero-padded: a one-token pass over a block reads memory as one sequential stream."""
    n, r = w.shape[0], rows_per_tile
    rows = w.contiguous().view(torch.uint8).reshape(n, -1)  # [N, K bytes]
    blocks, chunks = -(-n // r), -(-rows.shape[1] // CHUNK_BYTES)
    tiles = _huge_page_bytes(blocks * chunks * r * CHUNK_BYTES).view(blocks, chunks, r, CHUNK_BYTES)
    if rows.shape == (blocks * r, chunks * CHUNK_BYTES):  # no padding: no temporary copy
        padded = rows
    else:
        padded = torch.nn.functional.pad(rows, (0, chunks * CHUNK_BYTES - rows.shape[1], 0, blocks * r - n))
    tiles.copy_(padded.view(blocks, r, chunks, CHUNK_BYTES).transpose(1, 2))
    return tiles


def untile_rows(tiles: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `tile_rows`: a new [n, k] tensor of `dtype`."""
    blocks, chunks, r = tiles.shape[:3]
    rows = tiles.transpose(1, 2).reshape(blocks * r, chunks * CHUNK_BYTES)[:n]
    width = k * torch.empty((), dtype=dtype).element_size()
    return rows[:, :width].contiguous().view(dtype)


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


AVX2_GROUP = 16
"""Output channels per group of the AVX2 kernel's packed weights."""
_AVX2_ORDER = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
"""Channel stored at each place of a group (its own inverse): the kernel's unpacks work per 128-bit half."""


def _pack_groups(w: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """w [N, K] -> [ceil(N/16), K, 16]: k-major groups of 16 channels (zero-padded), each in `order` if given."""
    n, k = w.shape
    groups = -(-n // AVX2_GROUP)
    padded = torch.zeros(groups * AVX2_GROUP, k, dtype=w.dtype)
    padded[:n] = w
    grouped = padded.view(groups, AVX2_GROUP, k)
    return (grouped if order is None else grouped[:, order]).transpose(1, 2).contiguous()


def pack_bf16_avx2(w: torch.Tensor) -> torch.Tensor:
    """bf16 w [N, K] -> the AVX2 kernel's layout [ceil(N/16), K, 16] (k-major groups of 16 channels, zero-padded)."""
    return _pack_groups(w.to(torch.bfloat16), _AVX2_ORDER)


def unpack_bf16_avx2(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The [N, K] weights of `pack_bf16_avx2`'s layout."""
    groups, k, _ = packed.shape
    return packed.transpose(1, 2)[:, _AVX2_ORDER].reshape(groups * AVX2_GROUP, k)[:n]


def pack_int8_avx2(q: torch.Tensor) -> torch.Tensor:
    """int8 q [N, K] -> the AVX2 int8 kernel's layout [ceil(N/16), K, 16], channels in natural order."""
    assert q.dtype == torch.int8
    return _pack_groups(q, None)


def unpack_int8_avx2(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The [N, K] weights of `pack_int8_avx2`'s layout."""
    groups, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(groups * AVX2_GROUP, k)[:n]


def unpack_bf16_avx2_to_f32(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """fp32 `out` [K, groups * 16] <- the packed bf16 groups [groups, K, 16] (contiguous), channels in natural
    order, in one pass of our AVX2 library (torch's strided copy of the same transposition is ~2x slower)."""
    groups, k, _ = packed.shape
    assert packed.dtype == torch.bfloat16 and packed.is_contiguous()
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == (k, groups * AVX2_GROUP)
    lib = _avx2_library()
    assert lib is not None
    lib.bf16_unpack_f32(packed.data_ptr(), groups, k, out.data_ptr(), torch.get_num_threads())
    return out


def bf16_gemm_avx2(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`bf16_gemm` for AVX2 CPUs (`avx2_available()`) on weights packed by `pack_bf16_avx2` (N = n): same
    contract, same values up to summation order."""
    assert packed.dtype == torch.bfloat16 and packed.is_contiguous() and packed.shape[2] == AVX2_GROUP
    assert bias is None or bias.dtype == torch.bfloat16
    return _gemm("bf16", x, packed, bias, n=n, lib=_avx2_library())


def int8_gemm_avx2(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_gemm` for AVX2 CPUs on weights packed by `pack_int8_avx2` (N = scale's length): (x q^T) * scale
    [M, N] in x's dtype; a row's result does not depend on the other rows."""
    assert packed.dtype == torch.int8 and packed.is_contiguous() and packed.shape[2] == AVX2_GROUP
    assert scale.dtype == torch.bfloat16
    return _gemm("int8", x, packed, scale, n=scale.shape[0], lib=_avx2_library())


def _check_tiles(tiles: torch.Tensor, n: int, row_bytes: int) -> None:
    # The kernel trusts these sizes: a mismatch would read past the tiles.
    assert tiles.is_contiguous() and tiles.shape[2:] == (TILE_ROWS, CHUNK_BYTES)
    assert tiles.shape[0] == -(-n // TILE_ROWS) and tiles.shape[1] == -(-row_bytes // CHUNK_BYTES)


def glue_applies(x: torch.Tensor) -> bool:
    """Whether the RMSNorm / attention kernels take this bf16 CPU inference tensor (never under autograd:
    a head in training keeps torch's ops)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled() and available()


def attend_applies(x: torch.Tensor, hd: int) -> bool:
    """Whether `attend` takes the queries of x (a layer's input or its queries): `glue_applies`, and a head
    size hd the kernel's registers hold (a multiple of 16, at most 256)."""
    return hd % 16 == 0 and hd <= 256 and glue_applies(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * bf16(x * rsqrt(mean(x^2) + eps)) over the last dim; x, weight bf16."""
    lib = _library()
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
    """Softmax attention for a few queries, fp32 inside: [B, T, H * hd] bf16 (o_proj's input layout)."""
    lib = _library()
    assert lib is not None
    b, h, t, hd = q.shape
    kvh, s = keys.shape[1], keys.shape[2]
    assert hd % 16 == 0 and hd <= 256 and keys.stride()[2:] == (hd, 1) and keys.stride() == values.stride()
    qc = q.contiguous()
    m = None if mask is None else mask.expand(b, 1, t, s).contiguous()
    out = torch.empty(b, t, h * hd, dtype=torch.bfloat16)
    lib.attend_bf16(qc.data_ptr(), keys.data_ptr(), values.data_ptr(), None if m is None else m.data_ptr(),
                    b, h, kvh, t, s, hd, keys.stride(0), keys.stride(1), scale, out.data_ptr(),
                    torch.get_num_threads())
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
    lib = _library()
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
    lib = _library()
    assert lib is not None and gate_up.dtype == torch.bfloat16
    x = gate_up.contiguous()
    i = x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], i, dtype=torch.bfloat16)
    lib.silu_mul_bf16(x.data_ptr(), x.numel() // (2 * i), i, y.data_ptr())
    return y
