"""Milliseconds of one single-token decode step (forward + logits + argmax) of a model per linear format,
with our kernels and with torch's (oneDNN for bf16, FBGEMM for int8-dynamic), and of a prompt's prefill.

    python benchmarks/kernels/decode_step.py [--model qwen2.5-coder-0.5b-instruct] [--formats int4-hybrid,int8]
        [--prefill-tokens 150]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.model import native_kernels
from specdecode.model.fast_linear import NATIVE_FORMATS, convert_linears
from specdecode.model.int4_linear import Int4HybridLinear
from specdecode.model.load import load_model


def step_ms(model: torch.nn.Module, context: int = 64, steps: int = 20,
            logits: list[torch.Tensor] | None = None) -> float:
    """Median ms of a decode step after a `context`-token prefill (the first two steps left out); each step's
    logits are appended to `logits` if given."""
    cache = model.new_cache(1, context + steps + 1)
    with torch.inference_mode():
        model(torch.ones(1, context, dtype=torch.long), torch.arange(context)[None], cache)
        cache.set_length(0, context)
        samples = []
        for i in range(steps):
            t0 = time.perf_counter()
            hidden = model(torch.tensor([[5]]), torch.tensor([[context + i]]), cache)
            step_logits = model.compute_logits(hidden[0, -1:])
            step_logits.argmax()
            if logits is not None:
                logits.append(step_logits)
            cache.set_length(0, context + i + 1)
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples[2:]) * 1e3


def prefill_ms(model: torch.nn.Module, tokens: int, repeats: int = 3) -> float:
    """Median ms of a `tokens`-token prefill into an empty cache (last position's logits only)."""
    samples = []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = model.new_cache(1, tokens + 1)
            t0 = time.perf_counter()
            hidden = model(torch.ones(1, tokens, dtype=torch.long), torch.arange(tokens)[None], cache)
            model.compute_logits(hidden[0, -1:]).argmax()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def kernel_name(model: torch.nn.Module, fmt: str) -> str:
    """Whose kernel the converted model's linears run on: ours (AVX512 or AVX2) or torch's."""
    hybrid_bf16 = {id(m.bf16) for m in model.modules() if isinstance(m, Int4HybridLinear)}  # prefill only
    flags = {(getattr(m, "native", False), getattr(m, "avx2", False)) for m in model.modules()
             if hasattr(m, "native") and id(m) not in hybrid_bf16}
    if (True, False) in flags:
        return "ours"
    if any(avx2 for _, avx2 in flags):
        return "ours (AVX2)"
    return {"bf16": "oneDNN", "int8-dynamic": "FBGEMM"}.get(fmt, "torch") if fmt in NATIVE_FORMATS else "–"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--formats", default="bf16,int8,int4-hybrid")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-tokens", type=int, default=150)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    p = args.prefill_tokens
    print(f"| {args.model} format | kernel | ms per token | ms per {p}-token prefill |\n|---|---|---:|---:|")
    for fmt in args.formats.split(","):
        ours = native_kernels.available() or native_kernels.avx2_available()
        kernels = [None, False] if fmt in NATIVE_FORMATS and ours else [False]  # None: ours where we have one
        printed = set()
        for native in kernels:
            model = load_model(args.model, torch.bfloat16, "cpu").model
            convert_linears(model, fmt, native=native)  # type: ignore[arg-type]
            kernel = kernel_name(model, fmt)
            if kernel not in printed:  # bf16 without AVX512 takes the AVX2 kernel either way
                printed.add(kernel)
                print(f"| {fmt} | {kernel} | {step_ms(model):.1f} | {prefill_ms(model, p):.0f} |", flush=True)
            del model


if __name__ == "__main__":
    main()
