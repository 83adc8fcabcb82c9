"""Milliseconds of a prompt's forward through one linear of the 1.5B target (1536 -> 8960, an MLP
up-projection), per format and kernel, for prompts of a few hundred tokens: what prefill costs.

Decode reads each weight once per token and is bound by memory; prefill multiplies every weight by
hundreds of rows and is bound by arithmetic, where bf16 dot products (oneDNN) do twice the work of fp32
FMAs per instruction. Below AVX512-BF16 the bf16 rows are ours: the AVX2 kernel at every row count, against an
fp32 matmul of converted weights (`SPECDECODE_ISA=avx2` runs a larger CPU as that class).

    python benchmarks/kernels/prefill_linears.py [--rows 128,512] [--threads 2]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from linear_kernels import seconds_per_pass  # the timing loop of the decode-side twin of this script

from specdecode.model import native_gemm, native_kernels, native_layouts
from specdecode.model.bf16_linear import BF16Linear, onednn_bf16_supported
from specdecode.model.int4_linear import Int4WeightLinear
from specdecode.model.int8_linear import Int8DynamicLinear, Int8WeightLinear

K, N = 1536, 8960


def variants(lin: torch.nn.Linear) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    w = lin.weight.detach().bfloat16()
    i8 = Int8WeightLinear(lin, native=False)
    if onednn_bf16_supported():
        out["bf16 packed (oneDNN)"] = BF16Linear(lin, native=False)
    elif native_kernels.avx2_available():  # AVX2 without AVX512: oneDNN's bf16 matmul refuses to run
        wp = native_layouts.pack_bf16_avx2(w)
        out["bf16, our AVX2 kernel (every row count)"] = lambda x: native_gemm.bf16_gemm_avx2(x.reshape(-1, K), wp, N)
        out["bf16, fp32 matmul on a whole fp32 copy per call"] = lambda x: F.linear(x.float(), w.float())
    out["int8-dynamic (FBGEMM)"] = Int8DynamicLinear(lin, native=False)
    out["int8 weight-only, torch"] = i8
    if onednn_bf16_supported():
        # int8 values are exact in bf16: a bf16 GEMM of x and q, then the channel scales.
        out["int8 weight-only, q as bf16 + oneDNN"] = lambda x: F.linear(x, i8.weight.to(torch.bfloat16)) * i8.scales
    if native_kernels.available():
        out["int8-dynamic, ours"] = Int8DynamicLinear(lin, native=True)
        out["bf16, ours (every row count: decode and prefill)"] = lambda x: native_gemm.bf16_gemm(x, w)
        out["bf16, torch matmul (row-major weights; rows not independent)"] = lambda x: F.linear(x, w)
        out["int8 weight-only, ours"] = Int8WeightLinear(lin, native=True)
        out["int4 weight-only, ours"] = Int4WeightLinear(lin, native=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128,512")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.02)
    rows = [int(r) for r in args.rows.split(",")]
    kernels = variants(lin)
    print("| kernel | " + " | ".join(f"{r} rows: ms" for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    with torch.inference_mode():
        for name, mod in kernels.items():
            cells = []
            for r in rows:
                x = torch.randn(1, r, K).to(torch.bfloat16)
                cells.append(f"{seconds_per_pass([mod], x) * 1e3:.1f}")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
