"""Milliseconds of one forward of T tokens (a verification) of the exact bf16 target, per bf16 kernel: the
AMX kernel and the AVX512 one, both models loaded once and timed in alternation (noise hits both alike).

Speculative decoding pays when verifying T tokens costs little more than one; on the Intel Xeon VMs the
AVX512 kernel's bf16 dot products make T = 16 cost ~3x T = 1, so the cost model picks short drafts there.

    python benchmarks/kernels/verify_cost.py [--model qwen2.5-coder-1.5b-instruct] [--tokens 1,4,8,16,32,64]
        [--rounds 3] [--prefill 150]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
from decode_step import prefill_ms

from specdecode.model import native_kernels
from specdecode.model.fast_linear import convert_linears
from specdecode.model.load import load_model

CONTEXT = 64


def forward_ms(model: torch.nn.Module, tokens: int, repeats: int = 3) -> float:
    """Median ms of a `tokens`-token forward after a CONTEXT-token prefill (the cache rewound each time)."""
    cache = model.new_cache(1, CONTEXT + tokens + 1)
    samples = []
    with torch.inference_mode():
        model(torch.ones(1, CONTEXT, dtype=torch.long), torch.arange(CONTEXT)[None], cache)
        cache.set_length(0, CONTEXT)
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            model(torch.full((1, tokens), 5), torch.arange(CONTEXT, CONTEXT + tokens)[None], cache)
            samples.append(time.perf_counter() - t0)
            cache.set_length(0, CONTEXT)
    return statistics.median(samples[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--tokens", default="1,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=150)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if not native_kernels.amx_available():
        raise SystemExit("no AMX kernel on this CPU (or SPECDECODE_AMX=0): nothing to compare")
    models = {}
    for kernel in ("amx", "avx512"):
        model = load_model(args.model, torch.bfloat16, "cpu").model
        with mock.patch.object(native_kernels, "amx_available", lambda k=kernel: k == "amx"):
            convert_linears(model, "bf16")
        models[kernel] = model
    counts = [int(t) for t in args.tokens.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for t in counts:
            for kernel, model in models.items():
                times.setdefault((kernel, t), []).append(forward_ms(model, t))
        for kernel, model in models.items():
            times.setdefault((kernel, -1), []).append(prefill_ms(model, args.prefill))
    print(f"| tokens | {' | '.join(f'{k}: ms (÷ 1 token)' for k in models)} |")
    print("|---:|" + "---:|" * len(models))
    for t in counts:
        cells = []
        for kernel in models:
            ms, one = statistics.median(times[(kernel, t)]), statistics.median(times[(kernel, counts[0])])
            cells.append(f"{ms:.0f} ({ms / one:.2f}×)")
        print(f"| {t} | {' | '.join(cells)} |")
    cells = [f"{statistics.median(times[(k, -1)]):.0f}" for k in models]
    print(f"| prefill of {args.prefill} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
