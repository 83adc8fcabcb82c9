"""Milliseconds of one single-token decode step (forward + logits + argmax) of a model per linear format,
with our kernels and with torch's (oneDNN for bf16, FBGEMM for int8-dynamic).

    python benchmarks/decode_step.py [--model qwen2.5-coder-0.5b-instruct] [--formats int4-hybrid,int8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.model import native_kernels
from specdecode.model.fast_linear import NATIVE_FORMATS, convert_linears
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--formats", default="bf16,int8,int4-hybrid")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"| {args.model} format | kernel | ms per token |\n|---|---|---:|")
    for fmt in args.formats.split(","):
        kernels = [True, False] if fmt in NATIVE_FORMATS and native_kernels.available() else [False]
        for native in kernels:
            model = load_model(args.model, torch.bfloat16, "cpu").model
            convert_linears(model, fmt, native=native)  # type: ignore[arg-type]
            theirs = {"bf16": "oneDNN", "int8-dynamic": "FBGEMM"}.get(fmt, "torch")
            kernel = ("ours" if native else theirs) if fmt in NATIVE_FORMATS else "–"
            print(f"| {fmt} | {kernel} | {step_ms(model):.1f} |", flush=True)
            del model


if __name__ == "__main__":
    main()
