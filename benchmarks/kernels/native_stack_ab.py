"""Decode step with the decoder layers in one native call (`native_stack`) against module by module, per linear
format, alternating in one process (this machine's memory speed flips within minutes), with the logits of both
compared bit for bit.

    python benchmarks/kernels/native_stack_ab.py [--model qwen2.5-coder-1.5b-instruct]
        [--formats bf16,int8-dynamic,int8,int4] [--rounds 6]
"""

from __future__ import annotations

import argparse

import torch
from decode_step import step_ms

from specdecode.bench.bandwidth import measure_bandwidth
from specdecode.model import native_stack
from specdecode.model.fast_linear import convert_linears
from specdecode.model.load import load_model


def decode(model: torch.nn.Module, stack: bool) -> tuple[float, torch.Tensor]:
    """Median ms of a decode step (`decode_step.step_ms`) with or without the stack, and the steps' logits."""
    native_stack.set_enabled(model, stack)
    logits: list[torch.Tensor] = []
    ms = step_ms(model, steps=16, logits=logits)
    return ms, torch.cat(logits)


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
