"""Decode step of the target per linear format against its memory floor, each step between two bandwidth
probes.

This machine's read bandwidth flips between two states (~31-35 and ~50-66 GB/s) within seconds to minutes,
so a floor computed from a probe taken minutes away from the decode it judges can be off by 1.5x either
way. Here every round times one decode step (`decode_step.step_ms`, context 64) of each format, all models
loaded once, with a probe just before and just after it. Floor ÷ decode uses their mean; a step whose probes
differ by more than 15% straddles a flip and is left out of the per-state medians (marked "~").

    python benchmarks/kernels/floor_pairs.py [--model qwen2.5-coder-1.5b-instruct]
        [--formats bf16,int8,int8-dynamic,int4] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from decode_step import step_ms

from specdecode.bench.bandwidth import measure_bandwidth, weight_bytes_per_token
from specdecode.model.fast_linear import convert_linears
from specdecode.model.load import load_model

FAST_GBPS = 45.0
"""Probes at or above this are the machine's fast memory state."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--formats", default="bf16,int8,int8-dynamic,int4")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {}
    for fmt in args.formats.split(","):
        model = load_model(args.model, torch.bfloat16, "cpu").model
        convert_linears(model, fmt)  # type: ignore[arg-type]
        models[fmt] = (model, weight_bytes_per_token(model)["bytes"])
    print("| round | " + " | ".join(f"{f}: probes GB/s, ms (floor ÷ decode)" for f in models) + " |")
    print("|---:|" + "---:|" * len(models))
    ratios: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        cells = []
        for fmt, (model, nbytes) in models.items():
            before = measure_bandwidth(1.0)["read_gb_per_s"]
            ms = step_ms(model)
            after = measure_bandwidth(1.0)["read_gb_per_s"]
            gbps = (before + after) / 2
            ratio = ms / (nbytes / (gbps * 1e9) * 1e3)
            steady = max(before, after) / min(before, after) <= 1.15
            if steady:
                ratios.setdefault((fmt, "fast" if gbps >= FAST_GBPS else "slow"), []).append(ratio)
            cells.append(f"{before:.0f}/{after:.0f}, {ms:.1f} ({ratio:.2f}×{'' if steady else ' ~'})")
        print(f"| {r + 1} | " + " | ".join(cells) + " |", flush=True)
    for state in ("slow", "fast"):
        cells = []
        for fmt in models:
            got = ratios.get((fmt, state), [])
            cells.append(f"{statistics.median(got):.2f}× (n={len(got)}, {min(got):.2f}–{max(got):.2f})" if got else "–")
        print(f"| median, {state} state | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
