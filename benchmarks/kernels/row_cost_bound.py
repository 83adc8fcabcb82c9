"""The marginal cost of a verification row of the GGUF forward, per CPU class, against the integer dot-product
bound of that class's kernel on this machine.

A verification forward of R tokens reads the weights once, but every row needs its own integer dot products:
per weight and row, 1/64 of a 512-bit `vpdpbusd` (the AVX512-VNNI kernel), 1/32 of a 256-bit one (AVX-VNNI)
or of a `vpmaddubsw` + `vpmaddwd` + add (AVX2). `instruction_rates.c` measures each one's rate on one core;
the bound of a row is the model's linear weights x that share / (rate x threads). The marginal cost is the
slope of a least-squares line through the forward's best time at 1..R rows (logits of every row included,
as in a verification; after a 64-token context). Each class runs in a child process of its own with
SPECDECODE_ISA set, since the switch is read when the package is imported.

    python benchmarks/kernels/row_cost_bound.py [--classes best,avx512vnni,avx2] [--rows 8] [--rounds 7]
        [--model qwen2.5-coder-1.5b-instruct] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONTEXT = 64
KERNEL_OP = {"avx512": "zmm vpdpbusd", "avxvnni": "ymm vpdpbusd", "avx2": "ymm maddubs+maddwd"}
"""The GGUF kernel (`gguf_linear.isa()`) -> the instruction (or sequence) of its inner product."""


def instruction_rates() -> dict[str, tuple[float, int]]:
    """name -> (G/s on one core, products per instruction), from `instruction_rates.c`."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "rates"
        subprocess.run(["cc", "-O2", str(HERE / "instruction_rates.c"), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    rates = {}
    for line in out.splitlines():
        name, rest = line[:20].strip(), line[20:].split()
        rates[name] = (float(rest[0]), int(rest[2]))
    return rates


def measure_class(model_name: str, rows: int, rounds: int, threads: int) -> dict[str, object]:
    """In this process (SPECDECODE_ISA already set): the kernel, the linear weights and the best ms per row
    count."""
    import torch

    from specdecode import cpu_isa
    from specdecode.fetch import resolve_model
    from specdecode.model import gguf_linear
    from specdecode.model.gguf_linear import GGUFLinear
    from specdecode.model.load import load_resolved

    torch.set_num_threads(threads)
    model = load_resolved(resolve_model(model_name), model_name, torch.bfloat16, torch.device("cpu"), "gguf").model
    weights = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, GGUFLinear))
    cache = model.new_cache(1, CONTEXT + rows + 1)
    best = {r: float("inf") for r in range(1, rows + 1)}
    with torch.inference_mode():
        model(torch.ones(1, CONTEXT, dtype=torch.long), torch.arange(CONTEXT)[None], cache)
        for warm in [False] + [True] * rounds:  # the first round warms up; rows in alternation so noise hits all alike
            for r in best:
                cache.set_length(0, CONTEXT)
                tokens = torch.full((1, r), 5)
                t0 = time.perf_counter()
                model.compute_logits(model(tokens, torch.arange(CONTEXT, CONTEXT + r)[None], cache)[0])
                if warm:
                    best[r] = min(best[r], (time.perf_counter() - t0) * 1e3)
    return {"class": cpu_isa.effective(), "kernel": gguf_linear.isa(), "weights": weights,
            "ms": {str(r): t for r, t in best.items()}}


def slope(ms: dict[str, float]) -> float:
    """Least-squares ms per added row."""
    xs = [int(r) for r in ms]
    ys = list(ms.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", default="best,avx512vnni,avx2",
                    help="comma list: best (the machine's own) or a SPECDECODE_ISA class to force")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure_class(args.model, args.rows, args.rounds, args.threads)))
        return
    from specdecode.bench.machine import class_env, cpu_line

    print(cpu_line())
    rates = instruction_rates()
    for name, (rate, products) in rates.items():
        print(f"  {name:20s} {rate:.2f} G/s per core, {products} products")
    print(f"\n| class | kernel | ms at 1 row | ms at {args.rows} rows | marginal ms/row | bound ms/row | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for cls in args.classes.split(","):
        env = class_env(cls)
        out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--rows", str(args.rows),
                              "--rounds", str(args.rounds), "--threads", str(args.threads)],
                             env=env, check=True, capture_output=True, text=True).stdout
        got = json.loads(out.strip().splitlines()[-1])
        rate, products = rates[KERNEL_OP[got["kernel"]]]
        bound = got["weights"] / products / (rate * 1e9 * args.threads) * 1e3
        marginal = slope(got["ms"])
        label = got["class"] + ("" if cls == "best" else " (forced)")
        print(f"| {label} | {got['kernel']} | {got['ms']['1']:.1f} | {got['ms'][str(args.rows)]:.1f} | "
              f"{marginal:.2f} | {bound:.2f} | {marginal / bound:.2f} |", flush=True)


if __name__ == "__main__":
    main()
