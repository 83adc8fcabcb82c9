"""Effective weight bandwidth of each CPU linear format for one token (decode), beyond the caches.

Runs 24 distinct 1536 x 8960 linears (an MLP up-projection of the 1.5B target; 330M weights, far more
than the caches hold) for a one-token input, eager and, for torch's weight-only kernels, through
torch.compile with inductor's max-autotune C++ GEMM templates (the WOQ int8 / int4 micro-kernels); the
weight-only formats also with our AVX512 kernels (`specdecode.model.native_gemm`).
GB/s = weight bytes read / seconds: a format within 1.3x of the memory floor needs about 1/1.3 of the
machine's read bandwidth here.

    python benchmarks/kernels/linear_kernels.py [--threads 2] [--no-compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.model import native_kernels
from specdecode.model.bf16_linear import BF16Linear
from specdecode.model.int4_linear import Int4WeightLinear
from specdecode.model.int8_linear import Int8DynamicLinear, Int8WeightLinear

K, N, LAYERS = 1536, 8960, 24
FORMATS = [  # (name, module, weight bytes per weight incl. scales, compile it too)
    ("bf16 (oneDNN, packed)", lambda lin: BF16Linear(lin, native=False), 2.0, False),
    ("int8-dynamic, FBGEMM", lambda lin: Int8DynamicLinear(lin, native=False), 1.0, False),
    ("int8 weight-only, torch", lambda lin: Int8WeightLinear(lin, native=False), 1.0, True),
    ("int4 weight-only (group 32), torch", lambda lin: Int4WeightLinear(lin, native=False), 0.5 + 4 / 32, True),
]
if native_kernels.available():
    FORMATS += [
        ("bf16, ours", lambda lin: BF16Linear(lin, native=True), 2.0, False),
        ("int8-dynamic, ours", lambda lin: Int8DynamicLinear(lin, native=True), 1.0, False),
        ("int8 weight-only, ours", lambda lin: Int8WeightLinear(lin, native=True), 1.0, False),
        ("int4 weight-only (group 128), ours", lambda lin: Int4WeightLinear(lin, native=True), 0.5 + 8 / 128, False),
    ]


def seconds_per_pass(mods: list[torch.nn.Module], x: torch.Tensor, repeats: int = 10) -> float:
    for _ in range(3):
        for m in mods:
            m(x)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m in mods:
            m(x)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor

    inductor.max_autotune = True
    inductor.max_autotune_gemm_backends = "CPP,ATEN"
    inductor.freezing = True
    torch.manual_seed(0)
    linears = [torch.nn.Linear(K, N, bias=False) for _ in range(LAYERS)]
    x = torch.randn(1, K, dtype=torch.bfloat16)  # [1, K]: one token
    print(f"| format | mode | ms per {LAYERS} linears | effective GB/s |\n|---|---|---:|---:|")
    for name, make, bytes_per_weight, compile_too in FORMATS:
        mods = [make(lin) for lin in linears]
        modes = [("eager", mods)]
        if not args.no_compile and compile_too:
            with torch.no_grad():
                modes.append(("compiled", [torch.compile(m) for m in mods]))
        for mode, ms in modes:
            with torch.no_grad():
                t = seconds_per_pass(ms, x)
            gbps = K * N * LAYERS * bytes_per_weight / t / 1e9
            print(f"| {name} | {mode} | {t * 1e3:.2f} | {gbps:.1f} |", flush=True)


if __name__ == "__main__":
    main()
