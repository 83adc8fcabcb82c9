"""The AVX2 bf16 GEMM (native_gemm.bf16_gemm_avx2), which runs the bf16 format on CPUs without AVX512-BF16,
where oneDNN's bf16 matmul refuses to run. It builds and is tested on any AVX2 CPU, with or without AVX512."""

from __future__ import annotations

import pytest
import torch

from specdecode.model import native_gemm, native_kernels, native_layouts
from specdecode.model.bf16_linear import BF16Linear, onednn_bf16_supported
from specdecode.model.int8_linear import Int8WeightLinear

pytestmark = pytest.mark.skipif(not native_kernels.avx2_available(), reason="no AVX2 CPU or no C compiler")


@pytest.mark.parametrize(("n", "k"), [(16, 3), (20, 5), (33, 1)])
def test_packing_round_trips_and_puts_channels_where_the_kernel_expects_them(n: int, k: int) -> None:
    w = torch.randn(n, k).bfloat16()
    packed = native_layouts.pack_bf16_avx2(w)
    assert packed.shape == (-(-n // 16), k, 16)
    assert torch.equal(native_layouts.unpack_bf16_avx2(packed, n), w)
    # the low 128-bit halves of a group's 16 values hold channels 0-3 and 4-7, the high halves 8-11 and 12-15
    assert torch.equal(packed[0, 0, 4:8], w[8:12, 0]) and torch.equal(packed[0, 0, 8:12], w[4:8, 0])


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp64 sum of the bf16-rounded inputs times the bf16 weights (+ bias)."""
    y = x.bfloat16().double() @ w.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize(("m", "k", "n"), [(1, 1536, 96), (3, 64, 40), (5, 1545, 33), (17, 16, 7), (2, 9, 5),
                                          (13, 40, 70), (2, 24, 100)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_reference_and_rows_are_independent(m: int, k: int, n: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    ref = _reference(x, w, bias)
    packed = native_layouts.pack_bf16_avx2(w)
    y = native_gemm.bf16_gemm_avx2(x, packed, n, bias)  # fp32 in, fp32 out
    assert y.dtype == torch.float32
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.bfloat16().double().abs() @ w.double().abs().T) + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()
    yb = native_gemm.bf16_gemm_avx2(x.bfloat16(), packed, n, bias)  # bf16 in: the same sums, rounded once at the end
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.bfloat16())
    for i in range(m):  # a row's result does not depend on the other rows of the call
        assert torch.equal(native_gemm.bf16_gemm_avx2(x[i : i + 1], packed, n, bias), y[i : i + 1])


@pytest.mark.parametrize("cls", ["avx2", "avx512vnni"])
def test_bf16_linear_takes_the_avx2_kernel_below_avx512_bf16(monkeypatch: pytest.MonkeyPatch, cls: str) -> None:
    monkeypatch.setenv("SPECDECODE_ISA", cls)  # as a CPU of that class (forced where this one has more)
    if not native_kernels.avx2_available():
        pytest.skip("the AVX2 kernel does not build or run here")
    assert not onednn_bf16_supported() or cls != "avx2"
    lin = torch.nn.Linear(48, 20).to(torch.bfloat16)
    module = BF16Linear(lin)
    assert module.avx2
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    packed = native_layouts.pack_bf16_avx2(lin.weight.detach())
    assert torch.equal(module(x), native_gemm.bf16_gemm_avx2(x, packed, 20, lin.bias.detach()))
    long = torch.randn(300, 48, dtype=torch.bfloat16)  # prefill rows: the same kernel, each row on its own
    assert torch.equal(module(long), native_gemm.bf16_gemm_avx2(long, packed, 20, lin.bias.detach()))
    assert torch.equal(module(long)[7:8], module(long[7:8]))


@pytest.mark.parametrize(("m", "k", "n"), [(1, 1536, 96), (4, 64, 40), (9, 45, 33), (2, 16, 7)])
def test_int8_kernel_matches_the_dequantized_reference_and_rows_are_independent(m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) / 100 + 1e-3).bfloat16()
    packed = native_layouts.pack_int8_avx2(q)
    assert packed.shape == (-(-n // 16), k, 16) and torch.equal(native_layouts.unpack_int8_avx2(packed, n), q)
    y = native_gemm.int8_gemm_avx2(x, packed, scale)
    ref = (x.bfloat16().double() @ q.double().T) * scale.double()
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.bfloat16().double().abs() @ q.double().abs().T) * scale.double()
    assert ((y.double() - ref).abs() <= bound + 1e-6).all()
    for i in range(m):
        assert torch.equal(native_gemm.int8_gemm_avx2(x[i : i + 1], packed, scale), y[i : i + 1])


def test_int8_weight_linear_takes_the_avx2_kernel_unless_torch_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_ISA", "avx2")  # as an AVX2 CPU (forced where this one has more)
    if not native_kernels.avx2_int8_available():
        pytest.skip("the AVX2 kernel does not build or run here")
    lin = torch.nn.Linear(48, 20)
    ours, torchs = Int8WeightLinear(lin), Int8WeightLinear(lin, native=False)
    assert ours.avx2 and not torchs.avx2
    assert torch.equal(ours.dequantized(), torchs.dequantized())
    x = torch.randn(5, 48)
    torch.testing.assert_close(ours(x), torchs(x), rtol=1e-2, atol=1e-2)  # torch rounds its output to bf16


@pytest.mark.parametrize(("m", "k", "n"), [(1, 1536, 100), (3, 45, 33), (70, 64, 17), (2, 7, 5)])
def test_f32_kernel_matches_the_reference_and_rows_are_independent(monkeypatch: pytest.MonkeyPatch, m: int, k: int,
                                                                   n: int) -> None:
    monkeypatch.setenv("SPECDECODE_ISA", "avx2")  # the AVX2 library's kernel (forced where this CPU has more)
    if native_kernels.f32_library() is None:
        pytest.skip("the AVX2 kernel does not build or run here")
    g = torch.Generator().manual_seed(m * k + n)
    x, w, bias = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    y = native_gemm.f32_gemm(x, w, bias)
    ref = x.double() @ w.double().T + bias.double()
    assert ((y.double() - ref).abs() <= 4 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T)
            + 1e-5).all()
    for i in range(m):
        assert torch.equal(native_gemm.f32_gemm(x[i : i + 1], w, bias), y[i : i + 1])
