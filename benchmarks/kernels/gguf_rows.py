"""Where a many-row forward's time goes on the GGUF kernels: decoder layers' linears of a model's shapes
(random Q4_K_M blocks: Q4_K, Q6_K for v and down as in half of a Q4_K_M file's layers; enough layers that
their weights do not stay in the last-level cache, as in a real forward), timed at 1 and R rows in
alternation (noise from other processes hits both alike), per linear kind and in all; the ratio R-row / 1-row
time is what a verification forward's linears cost against a decode step's.

    python benchmarks/kernels/gguf_rows.py [--rows 16] [--rounds 5] [--threads 2] [--layers 12] [--kernels avx512,avx2]
        [--hidden 1536 --ff 8960 --heads 12 --kv-heads 2] [--rows-max 8,16]

`--rows-max` builds the AVX512 kernel with each ROWS_MAX (rows served per decoded weight block) for an A/B.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from gguf_random import _data  # noqa: E402

from specdecode.model import gguf_linear  # noqa: E402
from specdecode.model.gguf_linear import GGUFLinear, Q  # noqa: E402


def layer(hidden: int, ff: int, heads: int, kv_heads: int, kernel: str) -> dict[str, GGUFLinear]:
    """The four linears of a decoder layer (fused q/k/v and gate/up), Q4_K with v and down in Q6_K."""
    import numpy as np

    rng = np.random.default_rng(0)
    kv = kv_heads * hidden // heads
    blocks = lambda n, k, t: (t, _data((n, k), t, rng))  # noqa: E731
    return {
        "qkv": GGUFLinear([blocks(hidden, hidden, Q.Q4_K), blocks(kv, hidden, Q.Q4_K), blocks(kv, hidden, Q.Q6_K)],
                          hidden, kernel=kernel),
        "o": GGUFLinear([blocks(hidden, hidden, Q.Q4_K)], hidden, kernel=kernel),
        "gate_up": GGUFLinear([blocks(ff, hidden, Q.Q4_K), blocks(ff, hidden, Q.Q4_K)], hidden, kernel=kernel),
        "down": GGUFLinear([blocks(hidden, ff, Q.Q6_K)], ff, kernel=kernel),
    }


def forward_ms(layers: list[dict[str, GGUFLinear]], x: torch.Tensor, xf: torch.Tensor) -> dict[str, float]:
    """Milliseconds per linear kind over one pass through all layers, in a forward's order."""
    out: dict[str, float] = {}
    for lins in layers:
        for name, lin in lins.items():
            t = time.perf_counter()
            lin(xf if name == "down" else x)
            out[name] = out.get(name, 0.0) + 1e3 * (time.perf_counter() - t)
    return out


def pick(runs: list[dict[str, float]], name: str) -> list[float]:
    return [sum(m.values()) if name == "all" else m[name] for m in runs]


_EXTRA: dict[str, ctypes.CDLL] = {}
_BUILT_IN = gguf_linear.library


def _library(isa: str) -> ctypes.CDLL | None:
    return _EXTRA[isa] if isa in _EXTRA else _BUILT_IN(isa)


def with_rows_max(rows_max: int) -> str:
    """Register an AVX512 kernel library built with ROWS_MAX = rows_max; its kernel name."""
    from specdecode.native_build import build_shared

    name = f"avx512-r{rows_max}"
    src = re.sub(r"#define ROWS_MAX \d+", f"#define ROWS_MAX {rows_max}", gguf_linear.source("avx512"), count=1)
    lib = ctypes.CDLL(str(build_shared(src, f"gguf-kernels-{name}", gguf_linear._FLAGS)))
    lib.gguf_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.gguf_repack.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_int]
    _EXTRA[name] = lib
    gguf_linear.library = _library  # type: ignore[assignment]
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=12, help="layers cycled through (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernels", default=None, help="comma list of ISAS (default: the one this CPU takes)")
    p.add_argument("--rows-max", default=None, help="comma list of ROWS_MAX values to build the AVX512 kernel with")
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--ff", type=int, default=8960)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = args.kernels.split(",") if args.kernels else [gguf_linear.isa()]
    if args.rows_max:
        kernels = [with_rows_max(int(r)) for r in args.rows_max.split(",")]
    models = {k: [layer(args.hidden, args.ff, args.heads, args.kv_heads, k) for _ in range(args.layers)]
              for k in kernels}
    inputs = {rows: (torch.randn(rows, args.hidden).bfloat16(), torch.randn(rows, args.ff).bfloat16())
              for rows in (1, args.rows)}
    times: dict[tuple[str, int], list[dict[str, float]]] = {}
    for r in range(args.rounds + 1):  # the first round warms up
        for k, layers in models.items():
            for rows, (x, xf) in inputs.items():
                ms = forward_ms(layers, x, xf)
                if r:
                    times.setdefault((k, rows), []).append(ms)
    print(f"{args.threads} threads, {args.layers} layers, {args.rounds} rounds; best (median) ms over the layers; "
          f"ratio = best {args.rows}-row / best 1-row")
    for k in models:
        for name in [*models[k][0], "all"]:
            t1, tr = (pick(times[(k, rows)], name) for rows in (1, args.rows))
            print(f"  {k:12s} {name:8s} 1 row {min(t1):8.2f} ({statistics.median(t1):8.2f})  {args.rows} rows "
                  f"{min(tr):8.2f} ({statistics.median(tr):8.2f})  ratio {min(tr) / min(t1):5.2f}")


if __name__ == "__main__":
    main()
