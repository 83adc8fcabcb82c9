"""Faster CPU execution of the Linear layers: the formats a loaded model's nn.Linear layers are converted into,
and which format a target or a draft takes.

- `bf16` (`bf16_linear`): the model's own bf16 weights, on our AMX, AVX512-BF16 or AVX2 kernel where one builds,
  else pre-packed once into oneDNN's blocked layout (the plain bf16 matmul re-packs on every call). Exact w.r.t.
  the bf16 model up to accumulation order.
- `f32` (`f32_linear`): the fp32 model's own weights on our AVX512 kernel, rows independent of each other.
- `int8` (`int8_linear`): weight-only int8 with per-channel scales (our AVX512 or AVX2 kernel where it builds;
  else `torch._weight_int8pack_mm`).
- `int8-dynamic` (`int8_linear`): int8 weights x int8 activations quantized per token at run time (our VNNI
  kernel, else FBGEMM's int8 GEMM): the fastest verification forward (docs/kernels.md).
- `int4` (`int4_linear`): weight-only int4 with group-wise scales/minima (our AVX512 kernel, groups of 128; else
  `torch._weight_int4pack_mm_for_cpu`, groups of 32).
- `int4-hybrid` (`int4_linear`): int4 for forwards of a few tokens, bf16 for prefill (drafts).
- `q8_0` (`gguf_linear.q8_0_linear`): llama.cpp's Q8_0 blocks on the GGUF kernels (heads below AVX512-BF16).
The quantized formats change the model: for drafts (which never change the output) or
explicit opt-in.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn

from specdecode.config import QUANTIZATIONS
from specdecode.model import native_kernels
from specdecode.model.bf16_linear import BF16Linear
from specdecode.model.f32_linear import F32Linear
from specdecode.model.gguf_linear import q8_0_linear
from specdecode.model.int4_linear import Int4HybridLinear, Int4WeightLinear
from specdecode.model.int8_linear import Int8DynamicLinear, Int8WeightLinear

LinearFormat = Literal["none", "bf16", "f32", "int8", "int8-dynamic", "int4", "int4-hybrid", "q8_0", "gguf"]
FORMATS: tuple[str, ...] = ("none", "bf16", "f32", "int8", "int8-dynamic", "int4", "int4-hybrid", "q8_0")
"""Formats `convert_linears` converts nn.Linear layers into ("gguf" linears are built at load instead)."""


_CONSTRUCTORS = {
    "bf16": BF16Linear,
    "f32": F32Linear,
    "int8": Int8WeightLinear,
    "int8-dynamic": Int8DynamicLinear,
    "int4": Int4WeightLinear,
    "int4-hybrid": Int4HybridLinear,
    "q8_0": q8_0_linear,
}


NATIVE_FORMATS: tuple[str, ...] = ("bf16", "f32", "int8", "int8-dynamic", "int4", "int4-hybrid")
"""Formats that run on our kernels or torch's (`native`)."""


def convert_linears(model: nn.Module, fmt: LinearFormat, native: bool | None = None) -> nn.Module:
    """Replace every nn.Linear (lm_head included) by the given CPU format, in place. `native` picks the
    kernels of a weight-only format (None: ours where available)."""
    if fmt in ("none", "gguf"):  # gguf: the linears were built from the file's blocks at load (gguf_model)
        return model
    if fmt not in _CONSTRUCTORS:
        raise ValueError(f"unknown linear format {fmt!r}; choose one of {', '.join(FORMATS)}")
    make = _CONSTRUCTORS[fmt]
    if native is not None and fmt in NATIVE_FORMATS:
        make = functools.partial(make, native=native)
    # Parents only: a list of every module would keep each replaced Linear (and its weights) alive until
    # the end, doubling the memory a conversion needs at its peak.
    parents = [m for m in model.modules() if any(isinstance(c, nn.Linear) for c in m.children())]
    for module in parents:
        for child_name in [n for n, c in module.named_children() if isinstance(c, nn.Linear)]:
            setattr(module, child_name, make(getattr(module, child_name)))
    if fmt not in ("bf16", "f32"):  # these keep the loaded weights themselves (mapped from the file): nothing to free
        _own_remaining_parameters(model)
    return model


def make_linear(linear: nn.Linear, fmt: LinearFormat) -> nn.Module:
    """One linear in the given format (as `convert_linears` makes them)."""
    return _CONSTRUCTORS[fmt](linear)


def _own_remaining_parameters(model: nn.Module) -> None:
    """Copy the parameters a quantizing conversion left in place (embeddings, norms) out of the weights file's
    memory map (the formats copy their own biases): while one loaded tensor lives, the whole file stays
    mapped and resident next to the new weights."""
    with torch.no_grad():
        for p in model.parameters():
            if p.device.type == "cpu":
                p.data = p.data.clone()


def target_linear_format(quantization: str, dtype: torch.dtype, device: torch.device) -> LinearFormat:
    """The target keeps its weights unless the user opts into quantization; on CPU in bf16 they run on
    the `bf16` format (same values, faster kernels), in fp32 on the `f32` format where our kernels run (same
    values, rows independent of each other)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if device.type != "cpu":
        if quantization != "none":
            raise ValueError(f"quantization {quantization!r} is implemented for CPU only")
        return "none"
    if quantization != "none":
        return quantization  # type: ignore[return-value]
    if dtype == torch.bfloat16:
        return "bf16"
    return "f32" if dtype == torch.float32 and native_kernels.f32_library() is not None else "none"


def draft_linear_format(quantization: str, dtype: torch.dtype, device: torch.device) -> LinearFormat:
    """A draft never changes the output, so "auto" takes the fastest single-token path on this CPU
    (`benchmarks/kernels/decode_step.py` times each format):
    - AVX512-BF16 (our kernels): int4, with bf16 for its prefill;
    - below AVX512-BF16: weight-only int8 on our AVX2 kernel (`LLM` times a head's linears against bf16 too:
      `format_choice`)."""
    if quantization == "auto":
        if device.type != "cpu" or dtype != torch.bfloat16:
            return "none"
        if not native_kernels.available() and native_kernels.avx2_int8_available():
            return "int8"
        return "int4-hybrid"
    if quantization in ("int4-hybrid", "q8_0"):
        if device.type != "cpu":
            raise ValueError(f"quantization {quantization!r} is implemented for CPU only")
        return quantization  # type: ignore[return-value]
    return target_linear_format(quantization, dtype, device)
