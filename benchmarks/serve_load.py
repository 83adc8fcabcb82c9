"""Serving throughput with and without speculation at concurrency 1, 2, 4, 8, 16.

Starts `specdecode serve` in a subprocess (or targets a running server with --url), then for each
concurrency level sends the same prompts from that many closed-loop streaming clients in two modes:
"plain" (every request sets `speculative: {"num_speculative_tokens": 0}`) and "spec" (the server's
speculative config), alternating plain, spec, spec, plain (`--rounds 2`) so that a machine whose speed
drifts during a level slows both modes alike. Both modes use the same engine, so the ratio isolates what
speculation buys under load. Greedy decoding is lossless, so both modes produce the same tokens; the script
checks it.

Example (the numbers recorded in BENCHMARKS.md)::

    python benchmarks/serve_load.py --model qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --num-prompts 32 --max-tokens 128 --out bench-out/serve_load

One method per run on HumanEval prompts (`--method eagle` drafts trees with the shipped head; `--draft` with
`--method draft` drafts with the draft model)::

    python benchmarks/serve_load.py --model qwen2.5-coder-1.5b-instruct --method eagle --dataset humaneval \\
        --num-prompts 32 --max-tokens 128 --out bench-out/serve_load_eagle
    python benchmarks/serve_load.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --method draft --dataset humaneval --num-prompts 32 --max-tokens 128 --out bench-out/serve_load_draft

Smoke run on a small model (the model as its own draft, a fixed k so that it drafts)::

    python benchmarks/serve_load.py --model smollm2-135m-instruct --draft smollm2-135m-instruct --method draft \\
        --num-speculative-tokens 3 --max-model-len 1024 --num-prompts 4 --max-tokens 16 --concurrency 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdecode.bench.datasets import DATASETS, load_prompts  # noqa: E402
from specdecode.bench.process import free_port, wait_healthy  # noqa: E402
from specdecode.cli_args import add_model_args  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    p.add_argument("--api-key", default=None, help="API key of the server (--url)")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma list of client counts (default: %(default)s)")
    p.add_argument("--dataset", default="spec_bench", help=f"one of {', '.join(DATASETS)} or a .jsonl path")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts sent at each level and mode")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each mode per level, alternating plain, spec, spec, plain (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="server batch rows (default: 16, or the highest concurrency if more), the same server for "
                        "a partial rerun as for the full table")
    p.add_argument("--salt-per-pass", action="store_true",
                   help="give every pass (level, round, mode) its own cache_salt: with --suffix-scope key a pass "
                        "drafts from its own earlier answers only, never from another pass's answers to the same "
                        "prompts")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the server")
    p.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    return p.parse_args(argv)


# ---- server ----------------------------------------------------------------------------------------------------


def start_server(args: argparse.Namespace, max_num_seqs: int,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`specdecode serve` with the model flags of `args` (and `extra` flags) on a free port, once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--model", args.model, "--dtype", args.dtype,
           "--quantization", args.quantization,
           "--port", str(port), "--max-num-seqs", str(max_num_seqs), "--max-waiting", str(4 * max_num_seqs),
           "--log-level", "warning", *extra]
    for flag, value in (("--device", args.device), ("--max-model-len", args.max_model_len),
                        ("--speculative-config", args.speculative_config), ("--draft", args.draft),
                        ("--method", args.method), ("--head", args.head),
                        ("--num-speculative-tokens", args.num_speculative_tokens),
                        ("--suffix-scope", args.suffix_scope)):
        if value is not None:
            cmd += [flag, str(value)]
    print("starting:", " ".join(cmd), file=sys.stderr)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, args.startup_timeout)
    except TimeoutError:
        proc.terminate()
        raise
    return proc, url


# ---- client ----------------------------------------------------------------------------------------------------


def stream_events(client: httpx.Client, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The parsed SSE events of one streamed chat completion; an HTTP or in-stream error raises."""
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            yield event


def one_request(client: httpx.Client, model: str, messages: list[dict[str, str]], args: argparse.Namespace,
                plain: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos, "seed": 0,
    }
    if plain:
        body["speculative"] = {"num_speculative_tokens": 0}
    if args.pass_salt:
        body["cache_salt"] = args.pass_salt
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    for event in stream_events(client, body):
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            piece = choice["delta"].get("content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
    latency = time.perf_counter() - t0
    spec = usage.get("speculative") or {}
    return {"text": "".join(text), "tokens": usage.get("completion_tokens", 0), "latency": latency,
            "ttft": ttft if ttft is not None else latency, "steps": spec.get("steps", 0),
            "mean_accepted_length": spec.get("mean_accepted_length", 0.0)}


def run_level(url: str, headers: dict[str, str], model: str, prompts: list[list[dict[str, str]]],
              concurrency: int, args: argparse.Namespace, plain: bool) -> dict[str, Any]:
    clients = [httpx.Client(base_url=url, headers=headers, timeout=None) for _ in range(concurrency)]
    try:
        t0, started = time.perf_counter(), time.time()
        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(one_request, clients[i % concurrency], model, m, args, plain)
                       for i, m in enumerate(prompts)]
            results = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()
    tokens = sum(r["tokens"] for r in results)
    steps = sum(r["steps"] for r in results)
    return {
        "concurrency": concurrency, "mode": "plain" if plain else "spec", "requests": len(results),
        "output_tokens": tokens, "seconds": wall, "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "steps": steps, "mean_accepted_length": tokens / steps if steps else 0.0,
        "ttft_p50": statistics.median(r["ttft"] for r in results),
        "latency_p50": statistics.median(r["latency"] for r in results),
        "texts": [r["text"] for r in results],
        "window": [started, started + wall],  # wall-clock span, to match a server's SPECDECODE_STEP_LOG lines
    }


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from the rounds of one mode at one level: tokens over seconds of them all."""
    if any(r["texts"] != runs[0]["texts"] for r in runs):
        raise RuntimeError("the rounds of one mode gave different texts")
    tokens, seconds = sum(r["output_tokens"] for r in runs), sum(r["seconds"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    return {**runs[0], "requests": sum(r["requests"] for r in runs), "output_tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0, "steps": steps,
            "mean_accepted_length": tokens / steps if steps else 0.0,
            "ttft_p50": statistics.median(r["ttft_p50"] for r in runs),
            "latency_p50": statistics.median(r["latency_p50"] for r in runs), "rounds": len(runs),
            "windows": [r["window"] for r in runs]}


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    by = {(r["concurrency"], r["mode"]): r for r in rows}
    lines = [header, "", "| concurrency | plain tok/s | spec tok/s | spec / plain | tau (spec) "
             "| p50 latency plain / spec (s) | identical |", "|---:|---:|---:|---:|---:|---:|:---:|"]
    for c in sorted({r["concurrency"] for r in rows}):
        plain, spec = by[(c, "plain")], by[(c, "spec")]
        ratio = spec["tokens_per_second"] / plain["tokens_per_second"] if plain["tokens_per_second"] else 0.0
        same = "yes" if plain["texts"] == spec["texts"] else "no"
        lines.append(f"| {c} | {plain['tokens_per_second']:.1f} | {spec['tokens_per_second']:.1f} | {ratio:.2f}x | "
                     f"{spec['mean_accepted_length']:.2f} | {plain['latency_p50']:.2f} / {spec['latency_p50']:.2f} | "
                     f"{same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.num_prompts < 1 or args.max_tokens < 1 or args.rounds < 1:
        raise SystemExit("--concurrency, --num-prompts, --max-tokens and --rounds must be positive")
    prompts = [p.messages for p in load_prompts(args.dataset)]
    prompts = (prompts * (args.num_prompts // len(prompts) + 1))[: args.num_prompts]
    args.pass_salt = None
    proc = None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.url:
        url = args.url.rstrip("/")
    else:
        # Every level resends the same prompts: without the prefix cache, plain and speculative runs prefill
        # alike, so the ratio measures speculation alone (benchmarks/prefix_cache.py measures the cache).
        proc, url = start_server(args, args.max_num_seqs or max(16, *levels), ("--no-prefix-caching",))
    try:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        for plain in (True, False):  # warm-up, excluded
            run_level(url, headers, model, prompts[:1], 1, args, plain)
        rows = []
        for c in levels:
            runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            # plain, spec, spec, plain, ...: a machine that drifts during a level slows both modes alike.
            for i in range(2 * args.rounds):
                plain = (i % 4) in (0, 3)
                args.pass_salt = f"pass-{c}-{i}" if args.salt_per_pass else None
                row = run_level(url, headers, model, prompts, c, args, plain)
                runs[plain].append(row)
                print(f"concurrency {c:>2} {row['mode']:<5} {row['tokens_per_second']:8.1f} tok/s "
                      f"({row['output_tokens']} tokens in {row['seconds']:.1f}s, "
                      f"tau {row['mean_accepted_length']:.2f})", file=sys.stderr)
            rows += [merge_runs(runs[True]), merge_runs(runs[False])]
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    spec_desc = args.speculative_config or (f"draft {args.draft}" if args.draft else args.method) or "server default"
    header = (f"Serving throughput: {args.model} ({args.dtype}, quantization {args.quantization}), "
              f"speculation: {spec_desc}; {args.num_prompts} "
              f"{args.dataset} prompts per cell, max_tokens {args.max_tokens}, temperature {args.temperature}")
    table = markdown(rows, header)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(table + "\n")
        slim = [{k: v for k, v in r.items() if k != "texts"} for r in rows]
        (args.out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                           "rows": slim}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
