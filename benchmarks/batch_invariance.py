"""Does a request's answer depend on what else runs? Greedy chat answers to MT-bench and GSM8K prompts compared:

- `LLM.chat` on all prompts as one batch against each prompt alone (the second pass hits the prefix cache);
- a server (`specdecode serve` on 127.0.0.1) answering them one at a time, then all at once, then all at once again
  with every prompt's prefix cached.

    python benchmarks/batch_invariance.py --model qwen2.5-coder-1.5b-instruct --method eagle
    python benchmarks/batch_invariance.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct
    python benchmarks/batch_invariance.py --model smollm2-135m-instruct --method ngram
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import load_prompts, parse_per_task

Conversation = list[dict[str, str]]


def conversations(n: int) -> list[Conversation]:
    """n prompts: one MT-bench question per category, then GSM8K questions (neither tuned on)."""
    prompts = load_prompts("mt_bench+gsm8k", per_task=parse_per_task(f"1,gsm8k={n}"))
    return [p.messages for p in prompts][:n]


def same(a: list[Any], b: list[Any]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def llm_check(args: argparse.Namespace, convs: list[Conversation]) -> str:
    spec = {"method": "draft", "model": args.draft} if args.draft else (
        {"method": args.method} if args.method else None)
    llm = LLM(args.model, speculative_config=spec, max_num_seqs=len(convs))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    batch = [o.token_ids for o in llm.chat(convs, params)]
    alone = [llm.chat([c], params)[0].token_ids for c in convs]
    return f"LLM.chat, a batch of {len(convs)} == one at a time (prefixes cached): {same(batch, alone)}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_check(args: argparse.Namespace, convs: list[Conversation]) -> str:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--model", args.model, "--port", str(port),
           "--max-num-seqs", str(len(convs)), "--served-model-name", "m", "--log-level", "warning"]
    cmd += ["--draft", args.draft] if args.draft else (["--method", args.method] if args.method else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (exit code {proc.poll()})")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)

        def ask(conv: Conversation) -> str:
            r = httpx.post(base + "/v1/chat/completions", timeout=600, json={
                "model": "m", "messages": conv, "max_tokens": args.max_tokens, "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]

        one_by_one = [ask(c) for c in convs]
        with ThreadPoolExecutor(len(convs)) as pool:
            concurrent = list(pool.map(ask, convs))
            cached = list(pool.map(ask, convs))
        return (f"served, one at a time == {len(convs)} concurrent streams: {same(one_by_one, concurrent)}; "
                f"== concurrent again, every prefix cached: {same(one_by_one, cached)}")
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--method", choices=["ngram", "eagle", "medusa"], default=None)
    p.add_argument("--draft", default=None, help="a draft model (the draft method)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    convs = conversations(args.num_prompts)
    label = args.draft and f"draft {args.draft}" or args.method or "plain"
    print(f"{args.model}, {label}: {llm_check(args, convs)}", flush=True)
    print(f"{args.model}, {label}: {served_check(args, convs)}", flush=True)


if __name__ == "__main__":
    main()
