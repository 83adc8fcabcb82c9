"""Milliseconds of the AVX2 bf16 kernel (`native_gemm.bf16_gemm_avx2`) over 24 distinct linears of the
1.5B target's MLP shapes (1536 -> 8960 and 8960 -> 1536 in turn; 660 MB, far beyond the caches), by number
of rows: one token (decode) up to a 64-node tree plus its root (verification). What a verification forward
costs next to a decode step on a CPU with AVX2 but no AVX512 decides how far speculation pays there.

With `--baseline-source FILE` (another version of cpu_kernels_avx2.c, e.g. from `git show REV:PATH`) both
run in the same process, in alternating order, and their outputs are compared (bit for bit when both sum in
the same order). A version that exports `bf16_pack_group` takes weights packed by
`native_layouts.pack_bf16_avx2`; one without it (the older path) the plain [N, K] weights.

    python benchmarks/kernels/avx2_rows.py [--rows 1,2,3,4,8,16,32,65] [--baseline-source OLD.c]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from specdecode.model import native_gemm, native_kernels, native_layouts

LAYERS = 24
SHAPES = ((8960, 1536), (1536, 8960))  # (N, K) in turn


def gemm(lib: ctypes.CDLL, x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x times the plain weights w[0] [N, K], given to `lib` in its layout (w[1]: packed)."""
    packed = hasattr(lib, "bf16_pack_group")
    return native_gemm._gemm("bf16", x, w[packed], None, n=w[0].shape[0], lib=lib)


def seconds(lib: ctypes.CDLL, weights: list[tuple[torch.Tensor, torch.Tensor]], xs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w in weights:
        gemm(lib, xs[w[0].shape[1]], w)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,8,16,32,65")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--baseline-source", type=Path)
    args = ap.parse_args()
    current = native_kernels.avx2_library()
    if current is None:
        raise SystemExit("the AVX2 kernel does not build or run here")
    libs = {"this kernel": current}
    if args.baseline_source:
        baseline = native_kernels.load_avx2_library(args.baseline_source, "cpu-kernels-avx2-baseline")
        if baseline is None:
            raise SystemExit(f"{args.baseline_source} does not build or run here")
        libs["baseline"] = baseline
    torch.manual_seed(0)
    plain = [torch.randn(*SHAPES[i % 2]).bfloat16() for i in range(LAYERS)]
    weights = [(w, native_layouts.pack_bf16_avx2(w)) for w in plain]  # both layouts: 1.3 GB
    names = list(libs)
    extra = " | this ÷ baseline | bit-equal | max relative difference |" if len(names) > 1 else " |"
    print("| rows | " + " | ".join(f"{n}: ms" for n in names) + extra)
    print("|---:|" + "---:|" * len(names) + ("---:|---|---:|" if len(names) > 1 else ""))
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for _, k in SHAPES}
        samples: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.repeats + 1):
            for n in names if r % 2 else names[::-1]:
                samples[n].append(seconds(libs[n], weights, xs))
        ms = [statistics.median(samples[n][1:]) * 1e3 for n in names]  # the first pass warms up
        cells = [f"{v:.1f}" for v in ms]
        if len(names) > 1:
            pairs = [(gemm(libs[names[0]], xs[k], w), gemm(libs[names[1]], xs[k], w))
                     for w, (_, k) in zip(weights[:2], SHAPES, strict=True)]
            same = all(torch.equal(a, b) for a, b in pairs)
            rel = max(float(((a - b).abs() / b.abs().max()).max()) for a, b in pairs)
            cells += [f"{ms[0] / ms[1]:.2f}", str(same), f"{rel:.1e}"]
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
