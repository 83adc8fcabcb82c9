"""The layer stack of the CPU classes below AVX512-BF16 (cpu_kernels_avx2.c `decode_layers`, forced here with
SPECDECODE_ISA): the module-by-module forward's bits, its linears called as GEMM functions."""

from __future__ import annotations

import pytest
import torch
from test_native_stack import assert_stack_bits_one_token_and_tree, forward_both, random_model

from specdecode.model import native_kernels, native_stack
from specdecode.model.fast_linear import convert_linears


@pytest.mark.parametrize("cls", ["avx2", "avx512vnni"])
def test_stack_gives_the_module_forwards_bits(monkeypatch: pytest.MonkeyPatch, cls: str) -> None:
    monkeypatch.setenv("SPECDECODE_ISA", cls)
    if native_kernels.glue_library() is None or native_kernels.available():
        pytest.skip("no AVX2 library here")
    model = random_model()
    convert_linears(model, "bf16")  # the AVX2 bf16 GEMM
    assert_stack_bits_one_token_and_tree(model)
    tokens, positions = torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[12, 13, 14], [12, 13, 14]])
    a, b, _ = forward_both(model, tokens, positions, None, None, prefix=12)
    assert torch.equal(a, b)


def test_stack_leaves_linears_without_a_gemm_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_ISA", "avx2")
    if native_kernels.glue_library() is None or native_kernels.available():
        pytest.skip("no AVX2 library here")
    model = random_model()
    convert_linears(model, "int8")  # weight-only int8 on the AVX2 GEMM: no GEMM-function entry
    assert native_stack.build(model) is None
