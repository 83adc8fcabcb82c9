"""`LLM.generate` on many prompts at once (one batch of up to max_num_seqs rows) against one prompt at a time.

For each method (bench method names: plain, eagle, draft, ngram, ...) the same LLM generates the prompts twice,
greedy: one `generate([prompt])` call per prompt, then one `generate(prompts)` call; the outputs must be identical.
Reports wall seconds and total output tokens per second of both, and batched / one-at-a-time.

The run recorded in BENCHMARKS.md::

    python benchmarks/generate_batch.py --model qwen2.5-coder-1.5b-instruct --methods plain,eagle \\
        --dataset humaneval --num-prompts 16 --max-tokens 128 --out bench-out/generate_batch

Smoke run on a small model::

    python benchmarks/generate_batch.py --model smollm2-135m-instruct --methods plain,ngram --num-prompts 2 \\
        --max-tokens 16
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdecode import LLM, SamplingParams  # noqa: E402
from specdecode.bench.datasets import DATASETS, load_prompts  # noqa: E402
from specdecode.bench.methods import parse_method  # noqa: E402
from specdecode.heads.shipped import shipped_heads  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--methods", default="plain,eagle", help="comma list of bench method names")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="draft model of draft methods")
    p.add_argument("--dataset", default="humaneval", help=f"one of {', '.join(DATASETS)} or a .jsonl path")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=None, help="batch rows (default: --num-prompts)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    return p.parse_args(argv)


def run_method(name: str, args: argparse.Namespace, messages: list[list[dict[str, str]]]) -> dict[str, Any]:
    spec = parse_method(name, args.draft, shipped_heads(args.model))  # eagle/medusa: the shipped head
    rows = args.max_num_seqs or len(messages)
    llm = LLM(args.model, dtype=args.dtype, speculative_config=spec.speculative_config,
              max_model_len=args.max_model_len, quantization=spec.quantization, max_num_seqs=rows)
    prompts = [llm.chat_prompt_ids(m) for m in messages]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    # Warm-up, and the cost model's batch shapes (measured the first time a call runs this many rows).
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    t0 = time.perf_counter()
    single = [llm.generate([p], params)[0] for p in prompts]
    single_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batched = llm.generate(prompts, params)
    batched_s = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in batched)
    identical = [o.token_ids for o in single] == [o.token_ids for o in batched]
    steps = sum(o.metrics["steps"] for o in batched)
    result = {"method": name, "prompts": len(prompts), "max_num_seqs": rows, "output_tokens": tokens,
              "one_at_a_time_seconds": single_s, "batched_seconds": batched_s,
              "one_at_a_time_tokens_per_second": sum(len(o.token_ids) for o in single) / single_s,
              "batched_tokens_per_second": tokens / batched_s, "batched_over_one_at_a_time": batched_s / single_s,
              "tau_batched": tokens / steps if steps else 0.0, "identical": identical}
    del llm
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    messages = [p.messages for p in load_prompts(args.dataset, limit=args.num_prompts)]
    results = []
    for name in [m.strip() for m in args.methods.split(",") if m.strip()]:
        r = run_method(name, args, messages)
        results.append(r)
        print(f"{name:<10} one at a time {r['one_at_a_time_seconds']:7.1f} s "
              f"({r['one_at_a_time_tokens_per_second']:6.1f} tok/s)  batched {r['batched_seconds']:7.1f} s "
              f"({r['batched_tokens_per_second']:6.1f} tok/s)  batched/one-at-a-time "
              f"{r['batched_over_one_at_a_time']:.2f}x  tau {r['tau_batched']:.2f}  identical {r['identical']}",
              file=sys.stderr)
    plain = next((r for r in results if r["method"] == "plain"), None)
    if plain is not None:
        for r in results:
            r["batched_over_plain_batched_speed"] = r["batched_tokens_per_second"] / plain["batched_tokens_per_second"]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"command": " ".join(sys.argv), "results": results},
                                                          indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
