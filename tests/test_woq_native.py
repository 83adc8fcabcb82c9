"""The AVX512 kernels (specdecode.model.woq_native: weight-only int8 / int4, and bf16) and their use by the
linears.

Parity with the dequantized weights uses the bounds of test_quantized_linears, for our kernel and for
torch's (the fallback) alike. A row's output must not depend on the other rows of the forward: that is
what makes speculative verification on a weight-only target give the tokens of plain decoding.
"""

from __future__ import annotations

import pytest
import torch
from linear_helpers import BF16_HALF_ULP, FP32_ULP, bf16_linear, check_bound, inputs

from specdecode.model import woq_native
from specdecode.model.fast_linear import NATIVE_BF16_MAX_ROWS, BF16Linear, Int4WeightLinear, Int8WeightLinear

needs_native = pytest.mark.skipif(not woq_native.available(), reason="no AVX512-BF16 CPU or no C compiler")
KERNELS = [pytest.param(True, id="native", marks=needs_native), pytest.param(False, id="torch")]
CLASSES = {"int8": Int8WeightLinear, "int4": Int4WeightLinear, "bf16": BF16Linear}


def test_pack_int4_layout() -> None:
    q = (torch.arange(256) * 7 % 16).to(torch.uint8).reshape(1, 256)  # two groups of 128
    packed = woq_native.pack_int4(q)
    assert packed.shape == (1, 128)
    assert torch.equal(woq_native.unpack_int4(packed), q)
    for group in range(2):
        for i in range(32):
            word = int(packed[0, group * 64 + 2 * i]) | int(packed[0, group * 64 + 2 * i + 1]) << 8
            for nibble in range(4):
                assert (word >> 4 * nibble) & 0xF == int(q[0, group * 128 + i + 32 * nibble])


@pytest.mark.parametrize("native", KERNELS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_parity_with_dequantized_weights(native: bool, fmt: str, rows: int) -> None:
    """bf16 in and out, then fp32 in and out (only our kernel keeps fp32: torch's rounds to bf16)."""
    lin = bf16_linear(256, 512, seed=rows)
    module = CLASSES[fmt](lin, native=native)
    w, b = module.dequantized(), lin.bias.detach()
    x = inputs(rows, 512, seed=100 + rows).bfloat16()
    check_bound(module(x), x.double(), w, b, BF16_HALF_ULP)
    with pytest.raises(AssertionError, match="the bound"):  # the bound sees the quantization
        check_bound(module(x), x.double(), lin.weight.detach(), b, BF16_HALF_ULP)
    if native:
        y = module(x.float())
        assert y.dtype == torch.float32
        # int4: sums of x * (128 + q) minus 128 * sum(x): fp32 slack for products up to ~16x |x * w|.
        rel = 4 * FP32_ULP if fmt == "int8" else 64 * FP32_ULP
        check_bound(y, x.double(), w, b, rel)


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_are_independent(fmt: str, dtype: torch.dtype) -> None:
    """Every row of a forward as large as a tree's verification equals that row alone, bit for bit."""
    # 102: not a multiple of the 4- or 16-row tiles
    module = CLASSES[fmt](bf16_linear(102, 256, seed=3), native=True)
    rows = NATIVE_BF16_MAX_ROWS if fmt == "bf16" else 70
    x = inputs(rows, 256, seed=4).to(dtype)
    x[5] *= 50  # one token with much larger activations
    full = module(x)
    for i in (0, 1, 5, 33, rows - 1):
        assert torch.equal(module(x[i : i + 1]), full[i : i + 1])
    assert torch.equal(module(x[3:8]), full[3:8])


@needs_native
def test_int8_input_width_not_a_multiple_of_16() -> None:
    lin = bf16_linear(37, 40, seed=5)
    module = Int8WeightLinear(lin, native=True)
    x = inputs(3, 40, seed=6).bfloat16()
    check_bound(module(x), x.double(), module.dequantized(), lin.bias.detach(), BF16_HALF_ULP)


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_bf16_kernel_parity(rows: int, bias: bool) -> None:
    """The model's own weights, fp32 accumulation, one rounding to bf16 (the bias is added before it);
    input width 200 is not a multiple of the 32 products of one instruction, 37 outputs not one of the tiles."""
    lin = bf16_linear(37, 200, seed=rows, bias=bias)
    module = BF16Linear(lin, native=True)
    b = None if lin.bias is None else lin.bias.detach()
    x = inputs(rows, 200, seed=100 + rows).bfloat16()
    check_bound(module(x), x.double(), lin.weight.detach(), b, BF16_HALF_ULP)
    y = module(x.float())  # fp32 in: rounded to bf16 first, fp32 out
    assert y.dtype == torch.float32
    check_bound(y, x.double(), lin.weight.detach(), b, 4 * FP32_ULP)


@needs_native
def test_bf16_prefill_takes_torch_matmul() -> None:
    """Longer forwards than a verification (prompt prefill) go to torch's bf16 matmul, same weights."""
    lin = bf16_linear(64, 128, seed=9)
    module = BF16Linear(lin, native=True)
    x = inputs(NATIVE_BF16_MAX_ROWS + 1, 128, seed=10).bfloat16()
    w, b = lin.weight.detach().bfloat16(), lin.bias.detach().bfloat16()
    assert torch.equal(module(x), torch.nn.functional.linear(x, w, b))
    check_bound(module(x), x.double(), lin.weight.detach(), lin.bias.detach(), BF16_HALF_ULP)


def test_int4_kernel_needs_whole_groups_of_128() -> None:
    assert Int4WeightLinear(bf16_linear(16, 96, seed=1)).native is False  # torch's kernel, groups of 32
    with pytest.raises(ValueError, match="multiple of the int4 group"):
        Int4WeightLinear(bf16_linear(16, 192, seed=1), native=True)


def test_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_NATIVE_KERNELS", "0")
    woq_native._library.cache_clear()
    try:
        assert not woq_native.available()
        assert not Int8WeightLinear(bf16_linear(16, 64, seed=1)).native
        with pytest.raises(ValueError, match="not available"):
            Int4WeightLinear(bf16_linear(16, 128, seed=1), native=True)
    finally:
        woq_native._library.cache_clear()


def test_convert_linears_picks_the_kernels() -> None:
    from specdecode.model.fast_linear import Int4HybridLinear, convert_linears

    model = torch.nn.Sequential(bf16_linear(16, 128, seed=1), bf16_linear(16, 128, seed=2))
    convert_linears(model, "int4-hybrid", native=False)
    assert all(isinstance(m, Int4HybridLinear) and not m.int4.native for m in model)
    model = torch.nn.Sequential(bf16_linear(16, 128, seed=1))
    convert_linears(model, "int8", native=False)
    assert not model[0].native
