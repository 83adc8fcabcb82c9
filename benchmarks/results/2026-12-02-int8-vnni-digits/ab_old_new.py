"""A/B of the weight-only int8 kernels, one process, random order per round, a bandwidth probe before each:
the FMA kernel of main (row-major int8, built from OLD_SOURCE) against the 3-digit VNNI kernel of kernel.patch.

    git show main:specdecode/model/kernels/cpu_kernels.c > /tmp/old.c   # before applying the patch
    git apply benchmarks/results/2026-12-02-int8-vnni-digits/kernel.patch
    M=1 python benchmarks/results/2026-12-02-int8-vnni-digits/ab_old_new.py /tmp/old.c 60

Each round times two passes over 12 distinct matrices (6 x 1536x8960, 6 x 8960x1536) with M rows of input;
GB/s = weight bytes streamed / time.
"""

import ctypes
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from specdecode.bench.bandwidth import measure_bandwidth
from specdecode.model import native_kernels as nk
from specdecode.model.fast_linear import Int8WeightLinear

torch.set_num_threads(2)
old = nk._load(Path(sys.argv[1]), "cpu-kernels-old", "cpu_supported")
PTR, INT, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
old.woq_int8_gemm.argtypes = [PTR, INT, I64, I64, PTR, PTR, I64, PTR, INT, INT]
M = int(os.environ.get("M", "1"))


def lin(n: int, k: int, seed: int) -> torch.nn.Linear:
    layer = torch.nn.Linear(k, n, bias=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    return layer


mods = [Int8WeightLinear(lin(n, k, i)) for i, (n, k) in enumerate([(1536, 8960), (8960, 1536)] * 6)]
qs = [nk.untile_rows(m.tiles, m.out_features, m.in_features, torch.int8) for m in mods]  # old kernel: row-major
xs = {k: torch.randn(M, k).bfloat16() for k in (1536, 8960)}


def run_old() -> None:
    for m, q in zip(mods, qs, strict=True):
        x, y = xs[m.in_features], torch.empty(M, m.out_features, dtype=torch.bfloat16)
        old.woq_int8_gemm(x.data_ptr(), 0, M, m.in_features, q.data_ptr(), m.scales.data_ptr(), m.out_features,
                          y.data_ptr(), 0, 2)


def run_new() -> None:
    for m in mods:
        m(xs[m.in_features])


res, probes, fn = {"old": [], "new": []}, [], {"old": run_old, "new": run_new}
for r in range(int(sys.argv[2])):
    probes.append(measure_bandwidth(0.5, 2)["read_gb_per_s"])
    for name in random.sample(list(fn), 2):
        fn[name]()
        t = time.perf_counter()
        for _ in range(2):
            fn[name]()
        res[name].append(2 * 12 * 1536 * 8960 / (time.perf_counter() - t) / 1e9)
    print(r, round(probes[-1], 1), {n: round(v[-1], 1) for n, v in res.items()}, flush=True)
for state, idx in (("fast", [i for i, p in enumerate(probes) if p >= 45]),
                   ("slow", [i for i, p in enumerate(probes) if p < 45])):
    if idx:
        print(state, len(idx), {n: round(statistics.median([v[i] for i in idx]), 1) for n, v in res.items()},
              "new/old per round median", round(statistics.median([res["new"][i] / res["old"][i] for i in idx]), 3))
