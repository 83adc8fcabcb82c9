"""Decode step with the decoder layers in one native call (`native_stack`) against module by module, per linear
format, alternating in one process (this machine's memory speed flips within minutes), with the logits of both
compared bit for bit.

    python benchmarks/native_stack_ab.py [--model qwen2.5-coder-1.5b-instruct] [--formats bf16,int8-dynamic,int8,int4]
        [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.bench.bandwidth import measure_bandwidth
from specdecode.model.fast_linear import convert_linears
from specdecode.model.load import load_model


def decode(model: torch.nn.Module, stack: bool, context: int = 64, steps: int = 16) -> tuple[float, torch.Tensor]:
    """Median ms of `steps` single-token steps after a `context`-token prefill, and their logits."""
    layers = model.model.layers
    # None: built at the next forward; a cached None stack: the module-by-module forward.
    model._native_stack = None if stack else (layers[0].self_attn.qkv_proj, layers[-1].mlp.down_proj, None)
    cache = model.new_cache(1, context + steps + 1)
    logits, times = [], []
    with torch.inference_mode():
        model(torch.arange(100, 100 + context)[None], torch.arange(context)[None], cache)
        cache.set_length(0, context)
        for i in range(steps):
            t0 = time.perf_counter()
            hidden = model(torch.tensor([[5 + i]]), torch.tensor([[context + i]]), cache)
            logits.append(model.compute_logits(hidden[0, -1:]))
            cache.set_length(0, context + i + 1)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, torch.cat(logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--formats", default="bf16,int8-dynamic,int8,int4")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| format | probe GB/s | one call ms | module by module ms | ratio | logits equal |")
    print("|---|---:|---:|---:|---:|---|")
    for fmt in args.formats.split(","):
        model = load_model(args.model, torch.bfloat16, "cpu").model
        convert_linears(model, fmt)  # type: ignore[arg-type]
        for _ in range(args.rounds):
            gbps = measure_bandwidth(1.0)["read_gb_per_s"]
            (a, la), (b, lb) = decode(model, True), decode(model, False)
            print(f"| {fmt} | {gbps:.1f} | {a:.1f} | {b:.1f} | {b / a:.2f}× | {torch.equal(la, lb)} |", flush=True)
        del model


if __name__ == "__main__":
    main()
