"""The CPU Linear formats (specdecode.model.fast_linear and its format modules), and speculative decoding on
quantized targets.

Parity: every format's output against float64 arithmetic on the weights its kernel really multiplies
by (``dequantized()``; for int8-dynamic also the per-token fake-quantized input). What is left is the
rounding of the kernel's own output (bf16: at most half a bf16 ulp per rounding; fp32: a few fp32 ulps)
and fp32 accumulation order, so the bounds are tight: each test also checks that the *unquantized*
weights fall outside them, i.e. that the bound sees a quantization error.

Greedy equivalence: speculative decoding on a quantized target (int8, int8-dynamic, int4) emits exactly
the tokens of plain decoding of the same quantized target.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from linear_helpers import BF16_HALF_ULP, FP32_ULP, bf16_linear, check_bound, inputs
from torch import nn

from specdecode import LLM, SamplingParams
from specdecode.cli import build_parser
from specdecode.config import DRAFT_QUANTIZATIONS, QUANTIZATIONS, SpeculativeConfig
from specdecode.model import native_kernels
from specdecode.model.bf16_linear import BF16Linear
from specdecode.model.fast_linear import FORMATS, convert_linears, draft_linear_format, target_linear_format
from specdecode.model.int4_linear import Int4HybridLinear, Int4WeightLinear
from specdecode.model.int8_linear import Int8DynamicLinear, Int8WeightLinear

TOKENS = [1, 4, 16]
SHAPES = [(256, 512), (512, 256)]  # (out_features, in_features): multiples of the int4 group and tiles
CONVERTED = [f for f in FORMATS if f not in ("none", "f32", "q8_0")]
"""f32: fp32 models only (test_native_kernels); q8_0: GGUF blocks with int8 activations per block of 32, tested
against the `gguf` package's dequantization in test_gguf_kernels and as a head format in test_format_choice."""


def convert(lin: nn.Linear, fmt: str) -> nn.Module:
    model = nn.Sequential(lin)
    convert_linears(model, fmt)  # type: ignore[arg-type]
    return model[0]


def effective_weight(module: nn.Module, lin: nn.Linear, rows: int) -> torch.Tensor:
    """The fp32 weight the module's kernel multiplies a forward of `rows` rows by."""
    if isinstance(module, Int4HybridLinear):
        return effective_weight(module.int4 if rows <= module.max_int4_rows else module.bf16, lin, rows)
    if isinstance(module, BF16Linear):
        return lin.weight.detach().float()  # bf16 numbers by construction: kept or packed exactly
    return module.dequantized()  # type: ignore[operator]


def fake_quantize_per_token(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """Symmetric per-row int8 quantize-dequantize, computed in fp32 like the module does (the scale's
    fp32 division decides which side of .5 a value rounds to, so float64 here could differ by a step)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / qmax
    q = torch.round(x / scale)
    assert q.abs().max() <= qmax
    return q.double() * scale.double()


@pytest.mark.parametrize("fmt", CONVERTED)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", TOKENS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_parity_with_dequantized_weights_bf16(fmt: str, shape: tuple[int, int], rows: int, bias: bool) -> None:
    """bf16 model: x and y are bf16; the kernel accumulates in fp32 and rounds its result to bf16 (then
    the weight-only formats add the bf16 bias: a second rounding)."""
    lin = bf16_linear(*shape, seed=rows, bias=bias)
    module = convert(lin, fmt)
    x = inputs(rows, shape[1], seed=100 + rows).bfloat16()
    y = module(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, shape[0])
    assert module(x.reshape(1, rows, -1)).shape == (1, rows, shape[0])
    w = effective_weight(module, lin, rows)
    b = None if lin.bias is None else lin.bias.detach()
    if isinstance(module, Int8DynamicLinear):
        # Exact integer accumulation, fp32 scaling (see the fp32 test), then one bf16 rounding.
        xq = fake_quantize_per_token(x.float(), module.qmax)
        check_bound(y, xq, w, b, BF16_HALF_ULP + 4 * FP32_ULP, accumulation=False)
    else:
        xq = x.double()
        check_bound(y, xq, w, b, BF16_HALF_ULP)
    quantized = fmt in ("int8", "int8-dynamic", "int4") or (fmt == "int4-hybrid" and rows <= 8)
    if quantized:  # the bound is tight enough to see the quantization of the weights (and activations)
        with pytest.raises(AssertionError, match="the bound"):
            check_bound(y, x.double(), lin.weight.detach(), b, BF16_HALF_ULP)


INT8_DYNAMIC_KERNELS = [
    pytest.param(True, id="native", marks=pytest.mark.skipif(not native_kernels.available(),
                                                             reason="no AVX512-BF16/VNNI CPU or no C compiler")),
    pytest.param(False, id="fbgemm"),
]


@pytest.mark.parametrize("native", INT8_DYNAMIC_KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", TOKENS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_int8_dynamic_parity_fp32(shape: tuple[int, int], rows: int, bias: bool, native: bool) -> None:
    """fp32 model: exact integer dot products (|sum| <= 127 * 127 * K < 2^24: exact in fp32 too), then
    times the weight scale, times the token scale, plus the bias: at most four fp32 roundings, so no
    accumulation slack and 4 ulps (2^-21 relative) of the magnitudes involved."""
    lin = bf16_linear(*shape, seed=rows, bias=bias)
    module = Int8DynamicLinear(lin, native=native)
    assert isinstance(module, Int8DynamicLinear)
    assert 127 * 127 * shape[1] < 2**24
    x = inputs(rows, shape[1], seed=100 + rows)
    y = module(x)
    assert y.dtype == torch.float32
    b = None if lin.bias is None else lin.bias.detach()
    w = module.dequantized()
    check_bound(y, fake_quantize_per_token(x, module.qmax), w, b, 4 * FP32_ULP, accumulation=False)
    # The weights really are int8 (at most 255 levels per row) and the activations per-token int8.
    assert all(len(torch.unique(row)) <= 255 for row in w)
    with pytest.raises(AssertionError, match="the bound"):
        check_bound(y, x.double(), w, b, 4 * FP32_ULP, accumulation=False)  # unquantized activations


@pytest.mark.parametrize("native", INT8_DYNAMIC_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_dynamic_rows_are_independent(dtype: torch.dtype, native: bool) -> None:
    """Per-token scales and exact integer accumulation: a row's output is the same, bit for bit, alone
    or among other rows (what verifying k tokens against k single-token forwards needs). torch's
    `linear_dynamic` (one scale for the whole input) would fail this: a large row coarsens the others."""
    lin = bf16_linear(512, 256, seed=7)
    module = Int8DynamicLinear(lin, native=native)
    x = inputs(16, 256, seed=8)
    x[5] *= 50  # one token with much larger activations
    x = x.to(dtype)
    full = module(x)
    for i in range(16):
        assert torch.equal(module(x[i : i + 1]), full[i : i + 1])
    assert torch.equal(module(x[4:8]), full[4:8])
    assert torch.equal(module(torch.zeros(2, 256, dtype=dtype)), lin.bias.detach().to(dtype).expand(2, -1))


def test_int8_dynamic_bytes_counted() -> None:
    from specdecode.bench.bandwidth import weight_bytes_per_token

    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    convert_linears(model, "int8-dynamic", native=False)
    assert weight_bytes_per_token(model)["bytes"] == 64 * 32 + 32 * 4  # FBGEMM's int8 weights + fp32 scales
    if native_kernels.available():
        model = nn.Sequential(nn.Linear(64, 32, bias=False))
        convert_linears(model, "int8-dynamic", native=True)
        assert weight_bytes_per_token(model)["bytes"] == 64 * 32 + 32 * 4 + 32 * 4  # + int32 weight sums


def test_quantization_choices_agree() -> None:
    assert QUANTIZATIONS == ("none", "int8", "int8-dynamic", "int4", "gguf")
    assert DRAFT_QUANTIZATIONS == ("auto", *QUANTIZATIONS, "int4-hybrid", "q8_0")
    args = build_parser().parse_args(["generate", "hi", "--quantization", "int8-dynamic"])
    assert args.quantization == "int8-dynamic"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--quantization", "int3"])
    assert SpeculativeConfig(method="ngram", quantization="int8-dynamic").quantization == "int8-dynamic"
    with pytest.raises(ValueError, match="int8-dynamic"):
        SpeculativeConfig(method="ngram", quantization="fp8")
    cpu = torch.device("cpu")
    for q in QUANTIZATIONS[1:]:
        assert target_linear_format(q, torch.bfloat16, cpu) == q
        assert target_linear_format(q, torch.float32, cpu) == q
    with pytest.raises(ValueError, match="int8-dynamic"):
        target_linear_format("int2", torch.bfloat16, cpu)


# ---- greedy equivalence on quantized targets ---------------------------------------------------

MAX_TOKENS = 40
QUANTIZED_CLASS = {"int8": Int8WeightLinear, "int8-dynamic": Int8DynamicLinear, "int4": Int4WeightLinear}
PROMPTS: list[str | list[int]] = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    [17, 86, 70, 16, 289, 17, 86, 70, 16, 289, 17, 86],  # repeats: n-gram drafts something
]


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_refs() -> dict[tuple[str, str], list[list[int]]]:
    """Plain greedy outputs of each quantized target, filled once per (quantization, dtype)."""
    return {}


def reference(cache: dict[tuple[str, str], list[list[int]]], path: Path, quant: str, dtype: str) -> list[list[int]]:
    if (quant, dtype) not in cache:
        plain = LLM(str(path), dtype=dtype, device="cpu", quantization=quant)
        cache[(quant, dtype)] = [o.token_ids for o in plain.generate(PROMPTS, greedy())]
    return cache[(quant, dtype)]


@pytest.mark.parametrize("quant", ["int8", "int8-dynamic", "int4"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("drafter", ["ngram", "same-draft", "other-draft"])
def test_quantized_target_speculative_equals_plain(
    tiny_llama_dir: Path, tiny_llama_other_dir: Path, plain_refs: dict[tuple[str, str], list[list[int]]],
    quant: str, dtype: str, drafter: str,
) -> None:
    """Speculation is lossless relative to the quantized target: the same tokens as plain decoding of it.

    The drafts: n-gram; the target's own (unquantized) checkpoint as draft model, which agrees with the
    quantized target most of the time, so verify forwards accept several tokens and reject some; a
    random model, which is rejected almost always."""
    refs = reference(plain_refs, tiny_llama_dir, quant, dtype)
    if drafter == "ngram":
        cfg: dict[str, object] = {"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    elif drafter == "same-draft":  # the quantized target drafting for itself: drafts get accepted
        cfg = {"method": "draft", "model": str(tiny_llama_dir), "num_speculative_tokens": 4,
               "draft_dtype": dtype, "quantization": quant}
    else:
        cfg = {"method": "draft", "model": str(tiny_llama_other_dir), "num_speculative_tokens": 4}
    spec = LLM(str(tiny_llama_dir), dtype=dtype, device="cpu", quantization=quant, speculative_config=cfg)
    assert isinstance(spec.target.model.lm_head, QUANTIZED_CLASS[quant])
    outs = spec.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == refs
    drafted = sum(o.metrics["draft_tokens"] for o in outs)
    accepted = sum(o.metrics["accepted_tokens"] for o in outs)
    assert drafted > 0
    if drafter == "same-draft":
        # Multi-token verify forwards happened and agreed with the drafts. Not always: the draft feeds the
        # prompt plus the first token in one forward, the target the prompt alone, and in bf16 a prefill
        # chunked differently moves logits by up to ~0.2 (measured), enough to flip a near-tie.
        assert accepted >= 0.9 * drafted
    for o in outs:
        m = o.metrics
        assert m["output_tokens"] == MAX_TOKENS and m["steps"] + m["accepted_tokens"] == MAX_TOKENS


@pytest.mark.parametrize("fmt", ["int8", "int8-dynamic", "int4-hybrid"])
def test_quantizing_conversion_keeps_no_loaded_tensor(tiny_qwen_dir, fmt: str) -> None:  # noqa: ANN001
    """After a quantizing conversion no tensor of the model shares memory with what was loaded (the weights
    file's memory map): one leftover (a norm, a bias, the embeddings) would keep the whole file resident."""
    from specdecode.model.fast_linear import convert_linears
    from specdecode.model.load import load_model

    def storage(t: torch.Tensor) -> int | None:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # opaque (mkldnn-packed) tensors
            return None

    model = load_model(tiny_qwen_dir, "bf16", "cpu").model
    originals = [p.detach() for p in model.parameters()]  # kept alive: their addresses cannot be reused
    convert_linears(model, fmt)  # type: ignore[arg-type]
    held = [t for m in model.modules() for t in [*m.parameters(recurse=False), *vars(m).values()]
            if isinstance(t, torch.Tensor)]
    assert held and not {storage(t) for t in held} & {storage(t) for t in originals}


@pytest.mark.parametrize(("avx512", "avx2", "expected"), [(True, True, "int4-hybrid"), (False, True, "int8"),
                                                          (False, False, "int4-hybrid")])
def test_auto_draft_format_is_the_fastest_single_token_path_of_the_cpu(
    avx512: bool, avx2: bool, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_kernels, "available", lambda: avx512)
    monkeypatch.setattr(native_kernels, "avx2_int8_available", lambda: avx2)
    cpu = torch.device("cpu")
    assert draft_linear_format("auto", torch.bfloat16, cpu) == expected
    assert draft_linear_format("auto", torch.float32, cpu) == "none"  # fp32 drafts stay as they are
    assert draft_linear_format("int8-dynamic", torch.bfloat16, cpu) == "int8-dynamic"  # an explicit choice wins
    assert draft_linear_format("int4-hybrid", torch.bfloat16, cpu) == "int4-hybrid"
