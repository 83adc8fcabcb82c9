"""A/B of the int4 passes with tiles_and_vnni.patch applied (0: bf16 dot products, 1: VNNI digits): parity
against the dequantized weights, then GB/s in L3 and streamed (as benchmarks/kernel_ceiling.py).

    python benchmarks/results/2026-12-02-int4-tiles-vnni/int4_ab.py [rounds]
"""

import random
import sys

import torch

sys.path.insert(0, "benchmarks")
from kernel_ceiling import best_gbps  # noqa: E402

from specdecode.model import native_kernels  # noqa: E402
from specdecode.model.fast_linear import Int4WeightLinear  # noqa: E402

torch.set_num_threads(2)
lib = native_kernels._library()
torch.manual_seed(0)
m = Int4WeightLinear(torch.nn.Linear(1536, 512, bias=False).to(torch.bfloat16), native=True)
ref_w = m.dequantized().float()
for rows in (1, 2, 3, 5):
    x = torch.randn(rows, 1536).to(torch.bfloat16)
    x[0, 7] = 300.0  # an outlier
    ref = x.float() @ ref_w.T
    errors = []
    for kernel in (0, 1):
        lib.set_int4_kernel(kernel)
        errors.append((m(x.float()).float() - ref).abs().max().item())
    print(rows, "max error: bf16 pass", errors[0], "VNNI pass", errors[1], "max |ref|", ref.abs().max().item())
k, bpw = 1536, 0.5 + 8 / 128
setups = []
for n, count, repeats in ((int(12e6 / (k * bpw)) // 16 * 16, 1, 200), (8960, 12, 10)):
    mods = [Int4WeightLinear(torch.nn.Linear(k, n, bias=False).to(torch.bfloat16), native=True) for _ in range(count)]
    setups.append((mods, k * n * bpw, repeats))
x = torch.randn(1, k).to(torch.bfloat16)
res: dict[tuple[int, int], list[float]] = {}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
    order = [0, 1]
    random.shuffle(order)
    for kernel in order:
        lib.set_int4_kernel(kernel)
        for si, (mods, nbytes, repeats) in enumerate(setups):
            res.setdefault((kernel, si), []).append(best_gbps(mods, x, nbytes, repeats))
for si, name in enumerate(["in L3", "streamed"]):
    print(name, "bf16 pass", [round(g, 1) for g in res[(0, si)]], "VNNI pass", [round(g, 1) for g in res[(1, si)]])
