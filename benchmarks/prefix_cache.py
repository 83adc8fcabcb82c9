"""Prefix caching and chunked prefill against a real server: three measurements, each with the feature on and off.

- ``multiturn``: MT-bench two-turn conversations served turn after turn (turn 2 carries turn 1's question and
  answer); time to first token of the second turn, prefix caching on vs ``--no-prefix-caching``.
- ``shared``: 16 requests sharing a ~1,000-token system prompt, sent at once; total time, caching on vs off.
- ``chunked``: 4 streaming requests run; once each has streamed, a ~4,000-token prompt arrives; the running
  streams' longest gap between tokens against their median gap, chunked prefill on
  (``--max-num-batched-tokens``) vs off (0: whole prompts).

Each mode starts its own `specdecode serve` (benchmarks/serve_load.py's `start_server`). Greedy outputs must be
equal between on and off; the script reports whether they are.

Example (the lead's run on the Qwen pair)::

    python benchmarks/prefix_cache.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --out bench-out/prefix_cache

Smoke run::

    python benchmarks/prefix_cache.py --model smollm2-135m-instruct --conversations 2 --turn-tokens 16 \\
        --shared-requests 4 --system-tokens 200 --long-tokens 400 --stream-tokens 48 --chunk 32 --out bench-out/pc-smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import start_server, stream_events  # noqa: E402

from specdecode.bench.datasets import dataset_path, read_jsonl  # noqa: E402
from specdecode.cli_args import add_model_args  # noqa: E402

SCENARIOS = ("multiturn", "shared", "chunked")
CLIENT_HEADERS: dict[str, str] = {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list (default: %(default)s)")
    p.add_argument("--conversations", type=int, default=20, help="MT-bench conversations (default: %(default)s)")
    p.add_argument("--turn-tokens", type=int, default=128, help="max_tokens of each turn (default: %(default)s)")
    p.add_argument("--shared-requests", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1000, help="shared system prompt length")
    p.add_argument("--shared-tokens", type=int, default=32, help="max_tokens of each shared-prompt request")
    p.add_argument("--max-num-seqs", type=int, default=8, help="server batch rows (default: %(default)s)")
    p.add_argument("--streams", type=int, default=4, help="running streams in `chunked`")
    p.add_argument("--stream-tokens", type=int, default=256, help="max_tokens of each running stream")
    p.add_argument("--long-tokens", type=int, default=4000, help="the arriving prompt's length")
    p.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens of the chunked-on server")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    return p.parse_args(argv)


# ---- client helpers -------------------------------------------------------------------------------------------


def stream_chat(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int,
                on_first: Any = None) -> dict[str, Any]:
    """One greedy streamed chat request: text, token-event arrival times, TTFT, usage."""
    body = {"model": str(client.headers["x-served-model"]), "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    for event in stream_events(client, body):
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            if choice["delta"].get("content"):
                times.append(time.perf_counter())
                text.append(choice["delta"]["content"])
                if on_first is not None and len(times) == 1:
                    on_first()
    ttft = times[0] - t0 if times else time.perf_counter() - t0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"text": "".join(text), "times": times, "ttft": ttft, "seconds": time.perf_counter() - t0,
            "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": cached}


def filler_text(client: httpx.Client, tokens: int, seed_texts: list[str]) -> str:
    """Text of about `tokens` tokens from the dataset's questions (cut with the server's own tokenizer)."""
    text = " ".join(seed_texts)
    while True:
        ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
        if len(ids) >= tokens:
            break
        text = text + " " + text
    return client.post("/detokenize", json={"tokens": ids[:tokens]}).json()["prompt"]


# ---- scenarios ----------------------------------------------------------------------------------------------------


def multiturn(url: str, args: argparse.Namespace, questions: list[list[str]]) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=None, headers=CLIENT_HEADERS) as client:
        stream_chat(client, [{"role": "user", "content": "Say hello."}], 4)  # warm-up
        ttft2, second_gap, texts, cached = [], [], [], []
        for turns in questions[: args.conversations]:
            messages = [{"role": "user", "content": turns[0]}]
            first = stream_chat(client, messages, args.turn_tokens)
            messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": turns[1]}]
            second = stream_chat(client, messages, args.turn_tokens)
            ttft2.append(second["ttft"])
            if len(second["times"]) > 1:  # the first decode step after the turn-2 prefill
                second_gap.append(second["times"][1] - second["times"][0])
            cached.append(second["cached_tokens"] / max(1, second["prompt_tokens"]))
            texts += [first["text"], second["text"]]
    return {"ttft2_median": statistics.median(ttft2), "ttft2_mean": statistics.fmean(ttft2),
            "turn2_first_gap_median": statistics.median(second_gap) if second_gap else 0.0,
            "cached_fraction_turn2": statistics.fmean(cached), "texts": texts}


def shared(url: str, args: argparse.Namespace, questions: list[list[str]]) -> dict[str, Any]:
    n = args.shared_requests
    clients = [httpx.Client(base_url=url, timeout=None, headers=CLIENT_HEADERS) for _ in range(n)]
    try:
        seeds = [t[0] for t in questions]
        system = filler_text(clients[0], args.system_tokens, seeds)
        warm = filler_text(clients[0], 64, seeds[::-1])  # a different prefix: warms the server, primes nothing
        stream_chat(clients[0], [{"role": "system", "content": warm}, {"role": "user", "content": "Hi."}], 4)
        asks = [[{"role": "system", "content": system}, {"role": "user", "content": seeds[i % len(seeds)]}]
                for i in range(n)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda i: stream_chat(clients[i], asks[i], args.shared_tokens), range(n)))
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()
    return {"seconds": wall, "ttft_median": statistics.median(r["ttft"] for r in results),
            "prompt_tokens": results[0]["prompt_tokens"],
            "cached_tokens": sum(r["cached_tokens"] for r in results), "texts": [r["text"] for r in results]}


def chunked(url: str, args: argparse.Namespace, questions: list[list[str]]) -> dict[str, Any]:
    import threading

    k = args.streams
    clients = [httpx.Client(base_url=url, timeout=None, headers=CLIENT_HEADERS) for _ in range(k + 1)]
    started = threading.Semaphore(0)
    try:
        seeds = [t[0] for t in questions]
        long_text = filler_text(clients[0], args.long_tokens, seeds)
        stream_chat(clients[0], [{"role": "user", "content": "Say hello."}], 4)  # warm-up
        with ThreadPoolExecutor(k + 1) as pool:
            runs = [pool.submit(stream_chat, clients[i], [{"role": "user", "content": seeds[i]}],
                                args.stream_tokens, started.release) for i in range(k)]
            for _ in range(k):  # every stream is producing tokens
                started.acquire()
            t_arrive = time.perf_counter()
            long_run = pool.submit(stream_chat, clients[k], [{"role": "user", "content": long_text}], 8)
            streams = [r.result() for r in runs]
            long = long_run.result()
    finally:
        for c in clients:
            c.close()
    gaps = [b - a for s in streams for a, b in zip(s["times"], s["times"][1:], strict=False)]
    during = [b - a for s in streams for a, b in zip(s["times"], s["times"][1:], strict=False)
              if b > t_arrive and a < t_arrive + long["ttft"]]
    median = statistics.median(gaps) if gaps else 0.0
    return {"max_gap": max(gaps, default=0.0), "median_gap": median,
            "max_over_median": max(gaps, default=0.0) / median if median else 0.0,
            "gaps_during_prefill": len(during), "long_prompt_tokens": long["prompt_tokens"],
            "long_ttft": long["ttft"], "texts": [s["text"] for s in streams] + [long["text"]]}


# ---- driver -----------------------------------------------------------------------------------------------------


def run_mode(args: argparse.Namespace, name: str, extra: tuple[str, ...], questions: list[list[str]]) -> Any:
    proc, url = start_server(args, args.max_num_seqs, extra)
    try:
        # The server checks the model name; the clients carry it in a header only this script reads.
        CLIENT_HEADERS["x-served-model"] = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        return {"multiturn": multiturn, "shared": shared, "chunked": chunked}[name](url, args, questions)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def same(on: dict[str, Any], off: dict[str, Any]) -> str:
    """How many outputs are equal between on and off (fp32: all; bf16: a prefill of another shape rounds
    differently, and a greedy near-tie may resolve the other way)."""
    equal = sum(a == b for a, b in zip(on["texts"], off["texts"], strict=True))
    return f"{equal} of {len(on['texts'])}"


def markdown(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"Prefix caching and chunked prefill: {args.model} ({args.dtype}), speculation: "
             f"{args.speculative_config or args.draft or args.method or 'none'}", ""]
    if "multiturn" in results:
        on, off = results["multiturn"]["on"], results["multiturn"]["off"]
        lines += [f"MT-bench, {args.conversations} two-turn conversations, {args.turn_tokens} tokens per turn: "
                  f"turn-2 TTFT median {on['ttft2_median']:.2f} s cached vs {off['ttft2_median']:.2f} s not "
                  f"(ratio {on['ttft2_median'] / off['ttft2_median']:.3f}x; target <= 0.2x); turn-2 prompt "
                  f"{100 * on['cached_fraction_turn2']:.0f}% cached; first to second token "
                  f"{on['turn2_first_gap_median']:.2f} s vs {off['turn2_first_gap_median']:.2f} s; outputs identical: "
                  f"{same(on, off)}", ""]
    if "shared" in results:
        on, off = results["shared"]["on"], results["shared"]["off"]
        lines += [f"{args.shared_requests} requests sharing a {on['prompt_tokens']}-token prompt "
                  f"(system {args.system_tokens}), {args.shared_tokens} tokens each: total {on['seconds']:.1f} s "
                  f"cached vs {off['seconds']:.1f} s not (ratio {on['seconds'] / off['seconds']:.2f}x; target "
                  f"<= 0.5x); {on['cached_tokens']} prompt tokens cached; outputs identical: "
                  f"{same(on, off)}", ""]
    if "chunked" in results:
        on, off = results["chunked"]["on"], results["chunked"]["off"]
        lines += [f"{args.streams} running streams, a {on['long_prompt_tokens']}-token prompt arrives: longest gap / "
                  f"median gap {on['max_over_median']:.1f}x chunked ({on['max_gap']:.2f} / {on['median_gap']:.2f} s, "
                  f"--max-num-batched-tokens {args.chunk}) vs {off['max_over_median']:.1f}x whole prompt "
                  f"({off['max_gap']:.2f} / {off['median_gap']:.2f} s; target <= 3x); the long prompt's TTFT "
                  f"{on['long_ttft']:.1f} s vs {off['long_ttft']:.1f} s; outputs identical: "
                  f"{same(on, off)}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [s for s in args.scenarios.split(",") if s]
    if any(s not in SCENARIOS for s in names):
        raise SystemExit(f"--scenarios: choose from {', '.join(SCENARIOS)}")
    questions = [row["turns"] for row in read_jsonl(dataset_path("mt_bench")) if len(row.get("turns", [])) >= 2]
    modes = {"multiturn": (("on", ()), ("off", ("--no-prefix-caching",))),
             "shared": (("on", ()), ("off", ("--no-prefix-caching",))),
             "chunked": (("on", ("--max-num-batched-tokens", str(args.chunk))),
                         ("off", ("--max-num-batched-tokens", "0")))}
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        results[name] = {}
        for mode, extra in modes[name]:
            print(f"{name}: {mode}", file=sys.stderr)
            results[name][mode] = run_mode(args, name, extra, questions)
    table = markdown(results, args)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(table + "\n")
        slim = {n: {m: {k: v for k, v in r.items() if k != "texts"} for m, r in modes_.items()}
                for n, modes_ in results.items()}
        (args.out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                           "results": slim}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
