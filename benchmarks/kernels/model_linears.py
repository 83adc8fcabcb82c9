"""GB/s of a real GGUF model's decoder linears on the GGUF kernels at one row, per linear kind (every layer's
linear of that kind in turn, so the weights stream from memory as in a decode step): which block types the
kernel reads at memory speed and which it does not.

    python benchmarks/kernels/model_linears.py [--models qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct]
        [--rounds 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from specdecode.fetch import resolve_model
from specdecode.model.gguf_linear import GGUFLinear, Q
from specdecode.model.load import load_resolved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | linear | shape | block types | µs | GB/s |\n|---|---|---|---|---:|---:|")
    for name in args.models.split(","):
        model = load_resolved(resolve_model(name), name, torch.bfloat16, torch.device("cpu"), "gguf").model
        kinds: dict[str, list[GGUFLinear]] = defaultdict(list)
        for path, mod in model.named_modules():
            if isinstance(mod, GGUFLinear) and ".layers." in path:
                kinds[path.rsplit(".", 1)[-1]].append(mod)
        for kind, mods in kinds.items():
            x = torch.randn(1, mods[0].in_features).to(torch.bfloat16)
            times = []
            with torch.inference_mode():
                for _ in range(args.rounds + 1):
                    t0 = time.perf_counter()
                    for m in mods:
                        m(x)
                    times.append((time.perf_counter() - t0) / len(mods))
            t = statistics.median(times[1:])
            types = "+".join(Q(ty).name for ty in mods[0].types)
            print(f"| {name} | {kind} | {mods[0].out_features} x {mods[0].in_features} | {types} | {t * 1e6:.0f} | "
                  f"{mods[0].weight_bytes / t / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
