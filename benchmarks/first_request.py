"""The first request of a fresh process against the same request later in a warm one: does a new process (costs
read from the cost cache) decode as fast from its first request?

Each of N processes loads the main job's set-up (`LLM` with the draft or method given) and runs the N prompts in
a rotated order, so that every prompt runs first in one process (cold: right after start-up) and later in the
others (warm). Per prompt, the first run's tokens/s is divided by the mean of its warm runs, and again at its
process's own pace (a shared machine slows whole processes); the geometric means of those ratios are reported.
Before that, one process runs with an empty cost cache (in a scratch SPECDECODE_HOME whose models are the real
ones) and its log lines saying that it measures costs, and how long that took, are shown; the rotated processes
then read what it wrote. Prompts: code_heldout.jsonl and MT-bench, alternately; greedy, chat template, prefill
included.

    python benchmarks/first_request.py [--prompts 4] [--max-tokens 128] [--method draft]
        [--model qwen2.5-coder-1.5b-instruct] [--draft qwen2.5-coder-0.5b-instruct]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def child(order: list[int], args: argparse.Namespace) -> None:
    """In this process: load, then each prompt of `order` in turn; prints one JSON line of tokens/s."""
    import logging

    from step_profile import prompts

    from specdecode import LLM, SamplingParams

    logging.basicConfig(level=logging.INFO)  # the start-up says whether it measures costs, and how long it took
    t0 = time.perf_counter()
    spec = {"method": args.method, **({"model": args.draft} if args.method == "draft" else {})}
    llm = LLM(args.model, speculative_config=spec)
    load = time.perf_counter() - t0
    chats = prompts(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    rates = {}
    for i in order:
        t = time.perf_counter()
        out = llm.chat([chats[i]], params)[0]
        rates[i] = len(out.outputs[0].token_ids) / (time.perf_counter() - t)
    print(json.dumps({"load_seconds": load, "rates": rates}))


def run_child(order: list[int], args: argparse.Namespace, env: dict[str, str]) -> tuple[dict, str]:
    cmd = [sys.executable, __file__, "--child", ",".join(map(str, order)), "--prompts", str(args.prompts),
           "--max-tokens", str(args.max_tokens), "--method", args.method, "--model", args.model, "--draft", args.draft]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--method", default="draft")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child([int(i) for i in args.child.split(",")], args)
        return
    from specdecode.bench.machine import cpu_line
    from specdecode.fetch import models_home

    print(cpu_line())
    real = models_home()
    with tempfile.TemporaryDirectory() as tmp:
        for sub in ("models", "native", "converted"):  # the real files; the costs start empty
            if (real / sub).exists():
                os.symlink(real / sub, Path(tmp) / sub)
        env = {**os.environ, "SPECDECODE_HOME": tmp, "SPECDECODE_COST_CACHE": "1"}
        n = args.prompts
        got, log = run_child(list(range(n)), args, env)
        said = [line for line in log.splitlines() if "measur" in line.lower()]
        print(f"empty cost cache: load {got['load_seconds']:.1f} s; the log says: {said or 'nothing'}")
        runs: list[tuple[list[int], dict[int, float]]] = []
        for shift in range(n):
            order = [(shift + j) % n for j in range(n)]
            got, _ = run_child(order, args, env)
            rates = {int(k): v for k, v in got["rates"].items()}
            runs.append((order, rates))
            print(f"process {shift + 1}: load {got['load_seconds']:.1f} s, order {order}, tok/s "
                  + ", ".join(f"{rates[i]:.1f}" for i in order), flush=True)
    warm = {i: [rates[i] for order, rates in runs if order[0] != i] for i in range(n)}
    warm_mean = {i: sum(v) / len(v) for i, v in warm.items()}
    # A shared machine slows whole processes: each process's pace is the geometric mean of its warm requests'
    # rates over those prompts' warm means, and its first request is compared at that pace.
    ratios, paced = [], []
    for order, rates in runs:
        first = order[0]
        pace = math.exp(sum(math.log(rates[i] / warm_mean[i]) for i in order[1:]) / (n - 1))
        ratios.append(rates[first] / warm_mean[first])
        paced.append(ratios[-1] / pace)
    print("first ÷ warm, per prompt: " + ", ".join(f"{r:.3f}" for r in ratios)
          + f"; geometric mean {math.exp(sum(map(math.log, ratios)) / n):.3f}")
    print("the same at each process's own pace: " + ", ".join(f"{r:.3f}" for r in paced)
          + f"; geometric mean {math.exp(sum(map(math.log, paced)) / n):.3f}")


if __name__ == "__main__":
    main()
