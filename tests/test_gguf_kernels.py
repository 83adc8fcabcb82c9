"""The GGUF kernels (`gguf_gemm`: AVX512-VNNI, AVX2 with and without AVX-VNNI, portable C, each forced in
turn) against the `gguf` package's dequantization times the activations.

Random block bytes are valid blocks of every type once their fp16 scales are set to finite values, so each
type is tested on arbitrary codes, scales and (K-quant) 6-bit sub-block scales.

Tolerance. The kernel rounds each row's activations per block of 32 to int8 (scale d = max|x| / 127), so an
activation is off by at most d / 2; everything after that is exact integer arithmetic plus fp32 scaling. For
output n the error is therefore at most sum over blocks b of (d_b / 2) * sum_{k in b} |w[n, k]|, which the test
checks (plus 1e-5 of sum |w x| for fp32 rounding). It also checks that the typical error is far below that
bound (relative RMS error < 2%) and that every row of a many-row forward equals its single-row forward bit
for bit. The kernels do the same integer sums and fp32 operations in the same order, so they also agree with
each other bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from specdecode.model import gguf_linear
from specdecode.model.gguf_linear import GGUFLinear

native = pytest.mark.skipif(not gguf_linear.available(), reason="GGUF kernels need a C compiler")
KERNELS = [pytest.param(k, marks=pytest.mark.skipif(gguf_linear.library(k) is None, reason=f"no {k} here"))
           for k in gguf_linear.ISAS]

Q = gguf_linear.Q
# Byte offsets of each type's fp16 fields within a block.
FP16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
               Q.Q6_K: [208]}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random [n, row bytes] blocks of `qtype` with finite scales (~0.01-0.05 in size, signs mixed for minima)."""
    rng = np.random.default_rng(seed)
    bk, ts = GGML_QUANT_SIZES[Q(qtype)]
    blocks = rng.integers(0, 256, size=(n, k // bk, ts), dtype=np.uint8)
    for off in FP16_FIELDS[Q(qtype)]:
        vals = rng.uniform(0.01, 0.05, size=(n, k // bk)).astype(np.float16)
        if qtype == Q.Q4_1 and off == 2:  # Q4_1's minimum is signed
            vals = -vals
        blocks[..., off : off + 2] = vals.view(np.uint8).reshape(n, k // bk, 2)
    return blocks.reshape(n, -1)


def bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Worst-case |error| [M, N] from rounding x per row and block of 32 to int8."""
    m, k = x.shape
    d = np.abs(x.reshape(m, k // 32, 32)).max(-1) / 127.0  # [M, B]
    wabs = np.abs(w).reshape(w.shape[0], k // 32, 32).sum(-1)  # [N, B]
    return 0.5 * d @ wabs.T + 1e-5 * (np.abs(x) @ np.abs(w).T)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", gguf_linear.KERNEL_TYPES, ids=lambda t: Q(t).name)
@pytest.mark.parametrize("rows", [1, 4, 16, 65])
def test_matmul_against_dequantized(kernel: str, qtype: int, rows: int) -> None:
    n, k = 48, 512
    raw = random_blocks(qtype, n, k)
    w = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n).to(torch.bfloat16)
    lin = GGUFLinear([(qtype, raw)], k, bias=bias, kernel=kernel)
    assert lin.native and lin.kernel == kernel and lin.weight_bytes == raw.nbytes
    y = lin(x).double().numpy()
    ref = x.double().numpy() @ w.T + bias.double().numpy()
    err = np.abs(y - ref)
    assert (err <= bound(x.double().numpy(), w)).all(), float((err / bound(x.double().numpy(), w)).max())
    assert np.sqrt((err**2).mean() / (ref**2).mean()) < 0.02
    single = torch.cat([lin(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(lin(x), single)


@pytest.mark.parametrize("qtype", gguf_linear.KERNEL_TYPES, ids=lambda t: Q(t).name)
def test_kernels_agree_bit_for_bit(qtype: int) -> None:
    """Every kernel this CPU runs gives the same bits, fp32 and bf16 activations, 1 to 9 rows and more."""
    kernels = [k for k in gguf_linear.ISAS if gguf_linear.library(k) is not None]
    if len(kernels) < 2:
        pytest.skip("one kernel here")
    n, k = 32, 768 if Q(qtype).name.endswith("_K") else 96
    raw = random_blocks(qtype, n, k, seed=3)
    bias = torch.randn(n).to(torch.bfloat16)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(5))
    for xs in (x, x.to(torch.bfloat16), x[:1], x[:9]):
        outs = [GGUFLinear([(qtype, raw)], k, bias=bias, kernel=name)(xs) for name in kernels]
        for name, y in zip(kernels[1:], outs[1:], strict=True):
            assert torch.equal(y, outs[0]), (name, kernels[0])


def test_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECDECODE_GGUF_ISA forces a kernel; by default the first of ISAS this CPU runs (and SPECDECODE_ISA allows)."""
    monkeypatch.setenv("SPECDECODE_GGUF_ISA", "scalar")
    assert gguf_linear.isa() == "scalar"
    assert GGUFLinear([(Q.Q8_0, random_blocks(Q.Q8_0, 16, 32))], 32).kernel == "scalar"
    monkeypatch.setenv("SPECDECODE_GGUF_ISA", "neon")
    with pytest.raises(ValueError, match="SPECDECODE_GGUF_ISA"):
        gguf_linear.isa()
    monkeypatch.delenv("SPECDECODE_GGUF_ISA")
    assert gguf_linear.isa() == next(k for k in gguf_linear.ISAS
                                     if gguf_linear.class_allows(k) and gguf_linear.library(k) is not None)


@native
@pytest.mark.parametrize("qtype", gguf_linear.KERNEL_TYPES, ids=lambda t: Q(t).name)
def test_native_repack_matches_numpy(qtype: int) -> None:
    raw = random_blocks(qtype, 32, 512, seed=7)
    assert torch.equal(gguf_linear.repack(qtype, raw, 512), gguf_linear.repack(qtype, raw, 512, native=False))


@native
def test_fused_parts_of_mixed_types() -> None:
    """q/k/v-style concatenation of differently quantized parts, bf16 in and out."""
    k = 256
    parts = [(Q.Q4_K, random_blocks(Q.Q4_K, 64, k, 1)), (Q.Q6_K, random_blocks(Q.Q6_K, 32, k, 2)),
             (Q.Q8_0, random_blocks(Q.Q8_0, 16, k, 3))]
    lin = GGUFLinear(parts, k)
    w = np.concatenate([dequantize(raw, t).reshape(-1, k) for t, raw in parts]).astype(np.float64)
    x = torch.randn(5, k).to(torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 112)
    xd = x.double().numpy()
    err = np.abs(y.double().numpy() - xd @ w.T)
    assert (err <= bound(xd, w) + np.abs(xd @ w.T) * 2**-8).all()  # plus the bf16 output's rounding


def test_fallback_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """No kernel (no C compiler, or SPECDECODE_NATIVE_KERNELS=0): the linear holds its dequantized weights, with
    a warning."""
    monkeypatch.setattr(gguf_linear, "isa", lambda: None)
    raw = random_blocks(Q.Q4_K, 16, 256)
    with pytest.warns(UserWarning, match="GGUF kernels unavailable"):
        lin = GGUFLinear([(Q.Q4_K, raw)], 256, dtype=torch.float32)
    assert not lin.native
    x = torch.randn(3, 256)
    want = x @ torch.from_numpy(dequantize(raw, Q.Q4_K).reshape(16, 256)).T
    torch.testing.assert_close(lin(x), want)
