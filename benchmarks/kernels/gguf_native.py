"""The GGUF path (`quantization="gguf"`: the file's own blocks) against the bf16 path and llama.cpp.

1. Milliseconds of a T-token forward (after a 64-token prefill, the cache rewound each time) of the target
   loaded both ways, timed in alternation so that noise from other processes hits both alike; the best of the
   rounds (a shared CPU only ever adds time) and the median.
2. Plain greedy decode tokens/s on a short chat prompt: ours on the GGUF path, and llama.cpp's Python binding
   (`llama_cpp.Llama(model_path=..., n_threads=2)`) on the same file, alternated; tokens/s is
   (N - 1) / (time of N tokens - time of 1 token), so prompt processing is left out of both.

    python benchmarks/kernels/gguf_native.py [--model qwen2.5-coder-1.5b-instruct] [--tokens 1,4,16,64] [--rounds 3]
        [--decode-tokens 64] [--threads 2] [--skip-bf16] [--skip-llamacpp]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.fetch import resolve_model
from specdecode.model.fast_linear import convert_linears
from specdecode.model.gguf_model import weight_bytes
from specdecode.model.load import load_resolved

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
CONTEXT = 64


def forward_ms(model: torch.nn.Module, tokens: int) -> float:
    """ms of one `tokens`-token forward after a CONTEXT-token prefill (the cache rewound after it)."""
    cache = model.new_cache(1, CONTEXT + tokens + 1)
    with torch.inference_mode():
        model(torch.ones(1, CONTEXT, dtype=torch.long), torch.arange(CONTEXT)[None], cache)
        cache.set_length(0, CONTEXT)
        model(torch.full((1, tokens), 5), torch.arange(CONTEXT, CONTEXT + tokens)[None], cache)  # warm-up
        cache.set_length(0, CONTEXT)
        t0 = time.perf_counter()
        model(torch.full((1, tokens), 5), torch.arange(CONTEXT, CONTEXT + tokens)[None], cache)
        return (time.perf_counter() - t0) * 1e3


def ours_decode_s(llm: object, tokens: int) -> float:
    from specdecode import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.chat([[{"role": "user", "content": PROMPT}]], params)
    return time.perf_counter() - t0


def llamacpp_decode_s(llama: object, tokens: int) -> float:
    t0 = time.perf_counter()
    llama.create_chat_completion([{"role": "user", "content": PROMPT}], max_tokens=tokens, temperature=0.0)
    return time.perf_counter() - t0


def tokens_per_s(run: object, n: int, rounds: int) -> list[float]:
    return [(n - 1) / max(run(n) - run(1), 1e-9) for _ in range(rounds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    gguf = load_resolved(path, args.model, torch.bfloat16, cpu, "gguf").model
    print(f"gguf path: loaded in {time.perf_counter() - t0:.1f} s, weights {weight_bytes(gguf) / 1e9:.3f} GB "
          f"(file {path.stat().st_size / 1e9:.3f} GB)", flush=True)
    models = {"gguf": gguf}
    if not args.skip_bf16:
        bf16 = load_resolved(path, args.model, torch.bfloat16, cpu).model
        models["bf16"] = convert_linears(bf16, "bf16")
    counts = [int(t) for t in args.tokens.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for t in counts:
            for name, model in models.items():
                times.setdefault((name, t), []).append(forward_ms(model, t))
    for stat in (min, statistics.median):
        for name in models:
            one = stat(times[(name, counts[0])])
            row = ", ".join(f"T={t} {stat(times[(name, t)]):.1f} ms ({stat(times[(name, t)]) / one:.2f}x)"
                            for t in counts)
            print(f"forward {name} ({stat.__name__}): {row}", flush=True)
        if "bf16" in models:
            print(f"gguf / bf16 ({stat.__name__}): " + ", ".join(
                f"T={t} {stat(times[('gguf', t)]) / stat(times[('bf16', t)]):.2f}x" for t in counts), flush=True)
    del models, gguf
    from specdecode import LLM

    llm = LLM(args.model, quantization="gguf", max_model_len=1024)
    runs = {"ours (gguf path)": lambda n: ours_decode_s(llm, n)}
    if not args.skip_llamacpp:
        from llama_cpp import Llama

        llama = Llama(model_path=str(path), n_threads=args.threads, n_ctx=1024, verbose=False)
        runs["llama.cpp"] = lambda n: llamacpp_decode_s(llama, n)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            rates[name] += tokens_per_s(run, args.decode_tokens, 1)
    for name, r in rates.items():
        print(f"plain decode {name}: best {max(r):.2f}, median {statistics.median(r):.2f} tok/s "
              f"(rounds: {', '.join(f'{v:.2f}' for v in r)})")
    if len(rates) == 2:
        (ours, theirs) = rates.values()
        print(f"ours / llama.cpp: best {max(ours) / max(theirs):.2f}x, "
              f"median {statistics.median(ours) / statistics.median(theirs):.2f}x")


if __name__ == "__main__":
    main()
