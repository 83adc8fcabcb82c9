"""The head format chosen by timing at load below AVX512-BF16 (specdecode/model/format_choice.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdecode.model import format_choice, gguf_linear, native_kernels
from specdecode.model.bf16_linear import BF16Linear
from specdecode.model.fast_linear import make_linear
from specdecode.model.int8_linear import Int8WeightLinear


def small_head() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64, bias=False)).to(torch.bfloat16)


@pytest.mark.parametrize(("int8_seconds", "expected"), [(1.0, "bf16"), (0.1, "int8")])
def test_the_faster_format_wins(monkeypatch: pytest.MonkeyPatch, int8_seconds: float, expected: str) -> None:
    def fake(modules, widths, rounds=format_choice.ROUNDS, clock=None):  # noqa: ANN001, ANN202
        modules = list(modules)
        assert len(modules) == len(widths) == 2
        return int8_seconds if isinstance(modules[0], Int8WeightLinear) else 0.5

    monkeypatch.setattr(format_choice, "forward_seconds", fake)
    assert format_choice.fastest_format(small_head(), ("int8", "bf16")) == expected


def test_a_real_timing_leaves_the_model_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_ISA", "avx2")
    if not native_kernels.avx2_int8_available():
        pytest.skip("no AVX2 kernels here")
    head = small_head()
    before = [p.clone() for p in head.parameters()]
    assert format_choice.fastest_format(head, ("int8", "bf16")) in ("int8", "bf16")
    assert all(isinstance(m, nn.Linear) and not isinstance(m, BF16Linear) for m in head)
    assert all(torch.equal(a, b) for a, b in zip(before, head.parameters(), strict=True))


def test_one_candidate_is_taken_without_timing() -> None:
    assert format_choice.fastest_format(small_head(), ("int4-hybrid",)) == "int4-hybrid"


def test_q8_0_joins_the_candidates_where_a_vector_gguf_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_linear, "isa", lambda: "avx2")
    assert format_choice.head_formats_below_bf16() == ("int8", "bf16", "q8_0")
    monkeypatch.setattr(gguf_linear, "isa", lambda: "scalar")  # 30x slower: never worth timing
    assert format_choice.head_formats_below_bf16() == ("int8", "bf16")


@pytest.mark.skipif(gguf_linear.isa() in (None, "scalar"), reason="no vector GGUF kernel here")
def test_a_q8_0_head_linear_is_its_rounded_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(128, 64).to(torch.bfloat16)
    q8 = make_linear(lin, "q8_0")
    assert isinstance(q8, gguf_linear.GGUFLinear) and q8.native
    x = torch.randn(3, 128).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = q8(x).float(), lin(x).float()
    assert ((got - want).norm() / want.norm()).item() < 0.02  # int8 weights and activations, blocks of 32

    def fake(modules, widths, rounds=format_choice.ROUNDS, clock=None):  # noqa: ANN001, ANN202
        return 0.1 if isinstance(list(modules)[0], gguf_linear.GGUFLinear) else 0.5

    monkeypatch.setattr(format_choice, "forward_seconds", fake)
    assert format_choice.fastest_format(small_head(), ("int8", "bf16", "q8_0")) == "q8_0"
