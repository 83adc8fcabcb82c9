"""Compute ceiling of each of our one-token linear kernels: weight GB/s on ~12 MB of weights that stay in the
L3 cache (so memory does not limit them), next to the same kernels streaming 12 distinct 1536 x 8960 matrices.

A kernel whose ceiling is below the machine's read bandwidth cannot reach its memory floor however well it
streams: on these 2 Zen 4 cores int8 and int4 weight-only decode their weights at ~52 / ~45 GB/s.

    python benchmarks/kernels/kernel_ceiling.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.model.bf16_linear import BF16Linear
from specdecode.model.int4_linear import Int4WeightLinear
from specdecode.model.int8_linear import Int8DynamicLinear, Int8WeightLinear

FORMATS = [  # (name, module, weight bytes per weight incl. scales)
    ("bf16", BF16Linear, 2.0),
    ("int8-dynamic", Int8DynamicLinear, 1.0),
    ("int8 weight-only", Int8WeightLinear, 1.0),
    ("int4 weight-only", Int4WeightLinear, 0.5 + 8 / 128),
]


def best_gbps(mods: list[torch.nn.Module], x: torch.Tensor, weight_bytes: float, repeats: int) -> float:
    best = 0.0
    with torch.inference_mode():
        for _ in range(5):
            for m in mods:
                m(x)
            t0 = time.perf_counter()
            for _ in range(repeats):
                for m in mods:
                    m(x)
            best = max(best, repeats * len(mods) * weight_bytes / (time.perf_counter() - t0) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = 1536
    print("| format | in L3 (12 MB), GB/s | streamed (12 x 1536 x 8960), GB/s |\n|---|---:|---:|")
    for name, ctor, bpw in FORMATS:
        cells = []
        for n, count, repeats in ((int(12e6 / (k * bpw)) // 16 * 16, 1, 200), (8960, 12, 10)):
            mods = [ctor(torch.nn.Linear(k, n, bias=False).to(torch.bfloat16), native=True) for _ in range(count)]
            cells.append(best_gbps(mods, torch.randn(1, k).to(torch.bfloat16), k * n * bpw, repeats))
            del mods
        print(f"| {name} | {cells[0]:.1f} | {cells[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
