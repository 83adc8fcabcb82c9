"""The weight layouts the native GEMMs read (`native_gemm`): each format's weights re-laid out once at load, so
that one token's pass over them is a few sequential memory streams, and the inverse of each layout (for
`dequantized()` and the tests). Pure tensor code: nothing here needs the kernels to build."""

from __future__ import annotations

import ctypes
import mmap

import torch

TILE_ROWS, CHUNK_BYTES = 16, 64
"""The tiled layout of the int8 x int8 kernel's weights (see `tile_rows`)."""
INT8_TILE_ROWS = 4
"""Output channels of a weight-only int8 tile: the kernel's block (NR8 in cpu_kernels.c)."""
INT4_GROUP = 128
"""Input channels per int4 group: one 64-byte chunk of packed weights, one scale and minimum."""
INT4_TILE_ROWS = 4
"""Output channels of an int4 tile: the kernel's block (NR4 in cpu_kernels.c). One sequential stream per
thread instead of four row streams (docs/kernels.md, "Tiled weight layouts")."""
AMX_COLS, AMX_KSTEP = 64, 32
"""Output channels per group and k per tile step of the AMX kernel's packed weights."""
AVX2_GROUP = 16
"""Output channels per group of the AVX2 kernel's packed weights."""
_AVX2_ORDER = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
"""Channel stored at each place of a group (its own inverse): the kernel's unpacks work per 128-bit half."""

_HUGE_PAGE = 2 << 20


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of `nbytes`, in memory advised for transparent huge pages when large:
    weights streamed every token then cost fewer TLB misses."""
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
    tiles = huge_page_bytes(blocks * chunks * r * CHUNK_BYTES).view(blocks, chunks, r, CHUNK_BYTES)
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


def pack_bf16_amx(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] bf16 -> the AMX kernel's layout [ceil(N / 64), ceil(K / 32), 4, 16, 16, 2] (zero-padded):
    element [g, s, t, p, n, j] = w[64 g + 16 t + n, 32 s + 2 p + j]."""
    n, k = w.shape
    groups, steps = -(-n // AMX_COLS), -(-k // AMX_KSTEP)
    padded = torch.nn.functional.pad(w.to(torch.bfloat16), (0, steps * AMX_KSTEP - k, 0, groups * AMX_COLS - n))
    out = huge_page_bytes(padded.numel() * 2).view(torch.bfloat16).view(groups, steps, 4, 16, 16, 2)
    out.copy_(padded.view(groups, 4, 16, steps, 16, 2).permute(0, 3, 1, 4, 2, 5))
    return out


def unpack_bf16_amx(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack_bf16_amx`: a new [n, k] bf16 tensor."""
    groups, steps = packed.shape[:2]
    return packed.permute(0, 2, 4, 1, 3, 5).reshape(groups * AMX_COLS, steps * AMX_KSTEP)[:n, :k].contiguous()


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
