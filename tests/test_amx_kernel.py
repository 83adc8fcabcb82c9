"""The bf16 GEMM on AMX tiles (specdecode.model.native_gemm.bf16_gemm_amx, Intel CPUs with AMX-BF16) and
its use by BF16Linear and the native decoder stack.

The packing is pure torch and tested everywhere; the kernel only where the CPU has AMX. Its contract is the
AVX512 kernel's: parity with a float64 reference within bf16 rounding plus fp32 accumulation slack, and every
row of a forward equal, bit for bit, to that row alone (what makes verification give plain decoding's tokens).
"""

from __future__ import annotations

import pytest
import torch
from linear_helpers import BF16_HALF_ULP, FP32_ULP, bf16_linear, check_bound, inputs

from specdecode.model import native_gemm, native_kernels, native_layouts
from specdecode.model.bf16_linear import BF16Linear

needs_amx = pytest.mark.skipif(not (native_kernels.available() and native_kernels.amx_available()),
                               reason="no AMX-BF16 CPU or no C compiler")


def test_pack_bf16_amx_layout() -> None:
    """Groups of 64 channels, steps of 32 inputs, pairs of k inside a tile; zero padding; exact inverse."""
    w = torch.randn(100, 70).bfloat16()  # 2 groups (of 64), 3 steps (of 32)
    packed = native_layouts.pack_bf16_amx(w)
    assert packed.shape == (2, 3, 4, 16, 16, 2)
    for n in (0, 15, 16, 63, 64, 99):
        for k in (0, 1, 31, 32, 69):
            g, t, c = n // 64, n % 64 // 16, n % 16
            s, p, j = k // 32, k % 32 // 2, k % 2
            assert packed[g, s, t, p, c, j] == w[n, k]
    assert not packed[1, :, 3:].any() and not packed[1, :, 2, :, 4:].any()  # channels 100-127
    assert not packed[:, 2, :, 3:].any()  # inputs 70-95
    assert torch.equal(native_layouts.unpack_bf16_amx(packed, 100, 70), w)


@needs_amx
@pytest.mark.parametrize(("out_features", "in_features"), [(256, 512), (100, 200)])
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_parity_with_float64(out_features: int, in_features: int, rows: int) -> None:
    """bf16 in and out, then fp32 in and out; 100 x 200: a partial group and a partial step of k."""
    lin = bf16_linear(out_features, in_features, seed=rows)
    packed = native_layouts.pack_bf16_amx(lin.weight.detach().bfloat16())
    w, b = lin.weight.detach(), lin.bias.detach().bfloat16()
    x = inputs(rows, in_features, seed=100 + rows).bfloat16()
    check_bound(native_gemm.bf16_gemm_amx(x, packed, out_features, b), x.double(), w, b, BF16_HALF_ULP)
    y = native_gemm.bf16_gemm_amx(x.float(), packed, out_features, b)
    assert y.dtype == torch.float32
    check_bound(y, x.double(), w, b, 4 * FP32_ULP)
    with pytest.raises(AssertionError, match="the bound"):  # the bound sees a wrong weight
        check_bound(y, x.double(), w * 1.01, b, 4 * FP32_ULP)


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_are_independent(dtype: torch.dtype) -> None:
    """Every row of a 70-row forward (5 tiles of rows, the last partial) equals that row alone, bit for bit."""
    module = BF16Linear(bf16_linear(102, 256, seed=3), native=True)
    assert module.amx
    x = inputs(70, 256, seed=4).to(dtype)
    x[5] *= 50  # one token with much larger activations
    full = module(x)
    for i in (0, 1, 5, 16, 33, 69):
        assert torch.equal(module(x[i : i + 1]), full[i : i + 1])
    assert torch.equal(module(x[3:20]), full[3:20])


@needs_amx
def test_linear_keeps_no_row_major_copy() -> None:
    """The AMX layout replaces the [N, K] weights (a tied output matrix gets its own copy of them)."""
    module = BF16Linear(bf16_linear(64, 128, seed=1), native=True)
    assert not hasattr(module, "weight")
    assert torch.equal(native_layouts.unpack_bf16_amx(module.packed_amx, 64, 128),
                       bf16_linear(64, 128, seed=1).weight.detach().bfloat16())
