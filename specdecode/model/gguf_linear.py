"""GGUF models at their own quantization: linears that keep the file's quantized blocks (`quantization="gguf"`).

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K tensors are re-laid out once into tiles of 16 output channels
(kernels/gguf_common.c describes the layout; the bytes are the file's) and multiplied by `gguf_gemm`:
activations quantized per row and block of 32 to int8, exact integer block dot products, the blocks' scales
applied in fp32. Each decoded weight block serves several rows at once, so a verification forward of many
rows reads the weights once. The kernel is chosen at run time from the CPU's flags (`isa()`): AVX512-VNNI,
AVX2 with AVX-VNNI, AVX2 (+FMA), else portable C; all give the same bits.

Where no kernel builds (no C compiler, SPECDECODE_NATIVE_KERNELS=0) or a tensor has another type (F16,
Q2_K...), the linear keeps the dequantized weights in the model dtype instead, with a warning: the same
model, the bf16 path's memory, on our bf16 / fp32 kernel where it runs (rows independent), else torch's matmul.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from specdecode import cpu_isa
from specdecode.model import native_gemm, native_kernels, native_layouts

KERNELS = native_kernels.SOURCE.parent
ISAS = ("avx512", "avxvnni", "avx2", "scalar")
"""The kernels, fastest first: `isa()` takes the first that builds and runs on this CPU."""
_KERNEL_SOURCE = {"avx512": "gguf_kernels.c", "avxvnni": "gguf_kernels_avx2.c", "avx2": "gguf_kernels_avx2.c",
                  "scalar": "gguf_kernels_scalar.c"}
_KERNEL_FLAGS = {"avx512": [], "avxvnni": ["-mavx2", "-mfma", "-mavxvnni"], "avx2": ["-mavx2", "-mfma"],
                 "scalar": ["-lm"]}
# -ffp-contract=off: no fused multiply-adds but the written ones, so every kernel rounds alike.
_FLAGS = [*native_kernels.FLAGS, "-ffp-contract=off"]
Q = GGMLQuantizationType
KERNEL_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
"""Block types `gguf_gemm` multiplies in place."""
TILE = 16
"""Output channels per tile."""

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class Part(ctypes.Structure):
    """gguf_common.c's `gguf_part_t`."""

    _fields_ = [("type", ctypes.c_int64), ("n", ctypes.c_int64), ("data", ctypes.c_void_p)]


class LinearDesc(ctypes.Structure):
    """gguf_common.c's `gguf_linear_t`."""

    _fields_ = [("n_parts", ctypes.c_int64), ("parts", Part * 4)]


def source(isa: str) -> str:
    """The C source of one kernel's library: the shared part, the kernel, the GEMM around it."""
    return "\n".join((KERNELS / name).read_text() for name in ("gguf_common.c", _KERNEL_SOURCE[isa], "gguf_driver.c"))


@functools.cache
def library(isa: str) -> ctypes.CDLL | None:
    """The kernel library for `isa` (one of ISAS), if it builds and this CPU runs it."""
    if os.environ.get("SPECDECODE_NATIVE_KERNELS", "1") == "0":
        return None
    from specdecode.native_build import BuildError, build_shared

    try:
        path = build_shared(source(isa), f"gguf-kernels-{isa}", [*_FLAGS, *_KERNEL_FLAGS[isa]])
    except BuildError as exc:
        warnings.warn(f"GGUF kernels ({isa}) not built: {exc}", stacklevel=3)
        return None
    lib = ctypes.CDLL(str(path))
    if not lib.gguf_supported():
        return None
    lib.gguf_gemm.argtypes = [_P, _I, _L, _L, _P, _P, _L, _P, _I, _I]
    lib.gguf_gemm.restype = None
    lib.gguf_repack.argtypes = [_L, _P, _L, _L, _P, _I]
    lib.gguf_repack.restype = None
    return lib


def isa() -> str | None:
    """The kernel GGUF linears take: SPECDECODE_GGUF_ISA if set (one of ISAS, e.g. `avx2` to run the AVX2
    kernel on an AVX512 CPU), else the fastest this CPU runs and SPECDECODE_ISA allows; None where none builds."""
    forced = os.environ.get("SPECDECODE_GGUF_ISA", "")
    if forced:
        if forced not in ISAS:
            raise ValueError(f"SPECDECODE_GGUF_ISA={forced!r}: expected one of {', '.join(ISAS)}")
        return forced if library(forced) is not None else None
    return next((name for name in ISAS if class_allows(name) and library(name) is not None), None)


def class_allows(kernel: str) -> bool:
    """SPECDECODE_ISA lets `kernel` run: the AVX512 kernel from `avx512vnni` up; the AVX-VNNI one only where no
    class is forced (a forced class stands for CPUs without it); AVX2 and portable C always."""
    if kernel == "avx512":
        return cpu_isa.allows("avx512vnni")
    if kernel == "avxvnni":
        return cpu_isa.forced() is None
    return True


def available() -> bool:
    """A GGUF kernel builds and runs here (the scalar one wherever a C compiler is)."""
    return isa() is not None


def gemm_address(kernel: str | None = None) -> int:
    """Address of `gguf_gemm` of `kernel` (default: `isa()`), for the native decoder stack's GEMM_FN entries."""
    lib = library(kernel or isa() or "")
    assert lib is not None
    return ctypes.cast(lib.gguf_gemm, ctypes.c_void_p).value or 0


# ---- the file's blocks -> integer codes and per-channel header fields -------------------------------------


def _split(qtype: int, blocks: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, int]:
    """blocks [N, B, type bytes] -> (header fields [N, B, bytes] in the kernel's order, unsigned codes
    [N, B, weights per block], number of high-bit planes above the low nibble)."""
    if qtype == Q.Q8_0:
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return [blocks[..., :2]], codes, 0
    if qtype in (Q.Q4_0, Q.Q4_1):
        h = 2 if qtype == Q.Q4_0 else 4
        qs = blocks[..., h:]
        return [blocks[..., i : i + 2] for i in range(0, h, 2)], np.concatenate([qs & 15, qs >> 4], axis=-1), 0
    if qtype == Q.Q5_0:
        bits = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [N, B, 32]: bit i of the LE uint32
        qs = blocks[..., 6:]
        return [blocks[..., :2]], np.concatenate([qs & 15, qs >> 4], axis=-1) | (bits << 4), 1
    if qtype in (Q.Q4_K, Q.Q5_K):
        n, b = blocks.shape[:2]
        fields = [blocks[..., 0:2], blocks[..., 2:4], blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]]
        qh = blocks[..., 16:48] if qtype == Q.Q5_K else None
        qs = blocks[..., 48 if qh is not None else 16 :].reshape(n, b, 4, 1, 32)
        codes = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15).reshape(n, b, 8, 32)
        if qh is None:
            return fields, codes.reshape(n, b, 256), 0
        hi = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [N, B, 8 sub-blocks, 32]
        return fields, (codes | (hi << 4)).reshape(n, b, 256), 1
    if qtype == Q.Q6_K:
        n, b = blocks.shape[:2]
        ql = blocks[..., :128].reshape(n, b, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        qh = blocks[..., 128:192].reshape(n, b, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
        codes = (ql & 15).reshape(n, b, 256) | ((qh & 3).reshape(n, b, 256) << 4)
        scales = [blocks[..., 192 + i : 193 + i] for i in range(16)]
        return [blocks[..., 208:210], *scales], codes, 2
    raise ValueError(f"no GGUF kernel for {Q(qtype).name}")


def repack(qtype: int, raw: np.ndarray, k: int, native: bool = True) -> torch.Tensor:
    """The file's blocks of an [N, K] tensor (uint8 [N, row bytes]) in the kernel's tiles: uint8
    [N / 16, K / block, 16 * block bytes], the same number of bytes. `native`: `gguf_repack` (C, one pass)
    where it builds, else (and as its reference in the tests) numpy."""
    n = raw.shape[0]
    bk, ts = GGML_QUANT_SIZES[Q(qtype)]
    if n % TILE or k % bk:
        raise ValueError(f"{Q(qtype).name} [{n}, {k}]: rows must be a multiple of {TILE}, columns of {bk}")
    nb, t, subs = k // bk, n // TILE, bk // 32
    kernel = isa() if native else None
    lib = library(kernel) if kernel else None
    if lib is not None:
        src = np.ascontiguousarray(raw)
        dst = native_layouts.huge_page_bytes(src.size)
        lib.gguf_repack(int(qtype), src.ctypes.data, n, k, dst.data_ptr(), torch.get_num_threads())
        return dst.view(t, nb, TILE * ts)
    fields, codes, hi = _split(qtype, np.asarray(raw).reshape(n, nb, ts))
    out = [np.ascontiguousarray(f.reshape(t, TILE, nb, -1).transpose(0, 2, 1, 3)).reshape(t, nb, -1) for f in fields]
    c = codes.reshape(t, TILE, nb, subs, 32).transpose(0, 2, 3, 1, 4)  # [T, B, S, 16, 32]
    if qtype == Q.Q8_0:
        sub = c.reshape(t, nb, subs, TILE, 8, 4).transpose(0, 1, 2, 4, 3, 5).reshape(t, nb, subs, 512)
        planes = [sub]
    else:
        lo = (c & 15).reshape(t, nb, subs, TILE, 4, 2, 4)
        nib = (lo[..., 0, :] | (lo[..., 1, :] << 4)).transpose(0, 1, 2, 4, 3, 5)  # [T, B, S, 4, 16, 4]
        planes = [nib.reshape(t, nb, subs, 256)]
        for h in range(hi):
            bit = ((c >> (4 + h)) & 1).reshape(t, nb, subs, TILE, 8, 4).transpose(0, 1, 2, 4, 3, 5)
            planes.append(np.packbits(bit.reshape(t, nb, subs, 8, 64), axis=-1, bitorder="little").reshape(
                t, nb, subs, 64))
    out.append(np.concatenate(planes, axis=-1).reshape(t, nb, -1))
    tiles = np.concatenate(out, axis=-1)
    assert tiles.shape[-1] == TILE * ts
    dst = native_layouts.huge_page_bytes(tiles.size)
    dst.numpy()[:] = tiles.reshape(-1)
    return dst.view(t, nb, TILE * ts)


# ---- modules ----------------------------------------------------------------------------------------------


class GGUFLinear(nn.Module):
    """y = x w.T + bias with w the concatenation of `parts` (GGUF tensors of any supported types, e.g. q, k
    and v of a fused projection): each (type, raw uint8 [rows, row bytes]) over `in_features` columns.

    Forward: `gguf_gemm` on the repacked blocks; where that cannot run, the dequantized weights in `dtype`
    (torch's matmul)."""

    def __init__(self, parts: list[tuple[int, np.ndarray]], in_features: int, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16, kernel: str | None = None) -> None:
        super().__init__()
        self.kernel = kernel or isa()  # one of ISAS
        self.in_features = in_features
        self.out_features = sum(raw.shape[0] for _, raw in parts)
        self.types = tuple(int(t) for t, _ in parts)
        self.native = (self.kernel is not None and library(self.kernel) is not None and len(parts) <= 4
                       and all(t in KERNEL_TYPES for t in self.types)
                       and all(raw.shape[0] % TILE == 0 for _, raw in parts))
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).clone()
        if self.native:
            self.packed = [repack(t, raw, in_features) for t, raw in parts]
            self.packed_nbytes = sum(p.numel() for p in self.packed)  # bench.bandwidth's count of opaque weights
            self.desc = LinearDesc(len(parts))
            for i, ((t, raw), p) in enumerate(zip(parts, self.packed, strict=True)):
                self.desc.parts[i] = Part(int(t), raw.shape[0], p.data_ptr())
        else:
            if self.kernel is None:
                warnings.warn("GGUF kernels unavailable (no C compiler, or SPECDECODE_NATIVE_KERNELS=0): the GGUF "
                              "linears run dequantized", stacklevel=2)
            self.weight = torch.cat([torch.from_numpy(dequantize(raw, t).reshape(raw.shape[0], in_features))
                                     for t, raw in parts]).to(dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as held: the file's block bytes on the kernel."""
        if self.native:
            return self.packed_nbytes
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if not self.native:
            return self._dense(x)
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty(m, self.out_features, dtype=x2.dtype)
        f32 = int(x2.dtype == torch.float32)
        library(self.kernel).gguf_gemm(x2.data_ptr(), f32, m, self.in_features, ctypes.addressof(self.desc),
                             None if self.bias is None else self.bias.data_ptr(), self.out_features, y.data_ptr(),
                             f32, torch.get_num_threads())
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """The dequantized weights: our bf16 or fp32 kernel for inference on a CPU that runs it, else torch's."""
        w, bias = self.weight, self.bias
        fast = x.device.type == "cpu" and not torch.is_grad_enabled()
        if fast and native_kernels.available() and x.dtype == w.dtype == torch.bfloat16:
            y = native_gemm.bf16_gemm(x.reshape(-1, x.shape[-1]), w, bias)
        elif fast and native_kernels.f32_library() is not None and x.dtype == w.dtype == torch.float32:
            y = native_gemm.f32_gemm(x, w, None if bias is None else bias.float())
        else:
            return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)


class GGUFEmbedding(nn.Module):
    """Token embeddings read from the file's blocks (memory-mapped): only the rows looked up are dequantized,
    so the table costs no memory beyond the file's pages in use."""

    def __init__(self, qtype: int, raw: np.ndarray, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.qtype, self.raw, self.dim = int(qtype), raw, dim
        self.num_embeddings, self.embedding_dim = raw.shape[0], dim
        self.weight = nn.Parameter(torch.empty(0, dim, dtype=dtype), requires_grad=False)  # device and dtype only

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1).cpu().numpy()
        rows = dequantize(np.asarray(self.raw[ids]), self.qtype).reshape(len(ids), self.dim)
        return torch.from_numpy(np.ascontiguousarray(rows)).to(self.weight.dtype).reshape(*tokens.shape, self.dim)


def q8_0_linear(linear: nn.Linear) -> GGUFLinear:
    """An nn.Linear's weights rounded to Q8_0 blocks (32 int8 weights and an fp16 scale), on the GGUF kernels: a
    drafter's int8 format on every CPU class with VNNI (AVX512 or AVX-VNNI) and on AVX2."""
    w = linear.weight.detach().float().cpu().numpy()  # [N, K]
    return GGUFLinear([(Q.Q8_0, quantize(w, Q.Q8_0))], linear.in_features, bias=linear.bias)

