"""Decode step of the target per linear format against its memory floor, each step paired with a bandwidth
probe taken just before it.

This machine's read bandwidth flips between two states (~31-35 and ~50-60 GB/s) within seconds to minutes,
so a floor computed from a probe taken minutes away from the decode it judges can be off by 1.5x either
way. Here every round probes, then times one decode step (`decode_step.step_ms`, context 64) of each
format, all models loaded once; floor ÷ decode is computed per round from that round's probe.

    python benchmarks/floor_pairs.py [--model qwen2.5-coder-1.5b-instruct] [--formats bf16,int8,int8-dynamic,int4]
        [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from decode_step import step_ms

from specdecode.bench.bandwidth import measure_bandwidth, weight_bytes_per_token
from specdecode.model.fast_linear import convert_linears
from specdecode.model.load import load_model


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
    print("| probe GB/s | " + " | ".join(f"{f} ms (floor ÷ decode)" for f in models) + " |")
    print("|---:|" + "---:|" * len(models))
    ratios: dict[str, list[float]] = {f: [] for f in models}
    for _ in range(args.rounds):
        gbps = measure_bandwidth(1.0)["read_gb_per_s"]
        cells = []
        for fmt, (model, nbytes) in models.items():
            ms = step_ms(model)
            ratios[fmt].append(ms / (nbytes / (gbps * 1e9) * 1e3))
            cells.append(f"{ms:.1f} ({ratios[fmt][-1]:.2f}×)")
        print(f"| {gbps:.1f} | " + " | ".join(cells) + " |", flush=True)
    print("| median | " + " | ".join(f"{statistics.median(r):.2f}×" for r in ratios.values()) + " |")


if __name__ == "__main__":
    main()
