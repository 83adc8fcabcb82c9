"""Where a speculative step's time goes, per CPU class: the target's forward, the draft model's forwards, the
head, the rest of proposing (trees, lookups, packing), verification (sampling included), and the engine's own
bookkeeping (scheduling, commit and adaptation, admission), in ms per step and per output token.

Each phase is timed by wrapping the engine's phase methods and the drafter's modules with a clock (about a
microsecond per call), at batch 1, greedy, chat template, on a few held-out prompts (MT-bench and
benchmarks/data/code_heldout.jsonl). Every class runs in a child process with SPECDECODE_ISA set (the switch is
read when the package is imported). Prefill (the request's first forward) is left out.

    python benchmarks/step_profile.py [--classes best,avx512vnni,avx2] [--methods plain,draft,eagle]
        [--prompts 4] [--max-tokens 128] [--model qwen2.5-coder-1.5b-instruct]
        [--draft qwen2.5-coder-0.5b-instruct]
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("target forward", "draft model", "head", "proposer other", "verify", "schedule", "commit + adapt",
          "admit + prefill", "other")


def prompts(n: int) -> list[list[dict[str, str]]]:
    """Alternately a code prompt of code_heldout.jsonl and an MT-bench first turn (one per category)."""
    from specdecode.bench.datasets import load_prompts, parse_per_task

    code = load_prompts(str(ROOT / "benchmarks/data/code_heldout.jsonl"))
    chat = load_prompts("mt_bench", per_task=parse_per_task("1"))
    return [(code if i % 2 == 0 else chat)[i // 2].messages for i in range(n)]


def profile(method: str, model: str, draft: str, n: int, max_tokens: int) -> dict[str, Any]:
    """In this process: ms per phase over every decode step of n prompts."""
    from specdecode import LLM, SamplingParams
    from specdecode.engine import core

    spec = None if method == "plain" else {"method": method, **({"model": draft} if method == "draft" else {})}
    llm = LLM(model, speculative_config=spec)
    spent: dict[str, float] = defaultdict(float)

    def timed(phase: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[phase] += time.perf_counter() - t0
        return run

    engine_cls = core.Engine
    for name, phase in (("_schedule", "schedule"), ("_propose", "propose"), ("_target_forward", "target forward"),
                        ("_commit", "commit + adapt"), ("_admit", "admit + prefill"), ("step", "step")):
        setattr(engine_cls, name, timed(phase, getattr(engine_cls, name)))
    core.verify_rows = timed("verify", core.verify_rows)
    if llm.draft is not None:
        llm.draft.model.forward = timed("draft model", llm.draft.model.forward)
        llm.draft.model.compute_logits = timed("draft model", llm.draft.model.compute_logits)
    if llm.head is not None:
        llm.head.forward = timed("head", llm.head.forward)
        llm.head.draft_logits = timed("head", llm.head.draft_logits)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.chat([[{"role": "user", "content": "Hello"}]], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    spent.clear()
    tokens = steps = 0
    prefill = 0.0
    for msgs in prompts(n):
        out = llm.chat([msgs], params)[0]
        tokens += out.metrics["output_tokens"] - 1
        steps += out.metrics["steps"] - 1
        prefill += out.metrics["prefill_seconds"]
    spent["admit + prefill"] -= prefill  # the prompts' first forwards are not decode steps
    step = spent.pop("step") - prefill
    result = {p: spent.get(p, 0.0) for p in PHASES}
    result["proposer other"] = spent.get("propose", 0.0) - spent.get("draft model", 0.0) - spent.get("head", 0.0)
    result["other"] = step - sum(v for k, v in result.items() if k != "other")
    return {"steps": steps, "tokens": tokens, "step_seconds": step, "seconds": result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", default="best,avx512vnni,avx2")
    ap.add_argument("--methods", default="plain,draft,eagle")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(profile(args.child, args.model, args.draft, args.prompts, args.max_tokens)))
        return
    from specdecode import cpu_isa
    from specdecode.bench.machine import class_env, cpu_line

    print(cpu_line())
    print("\nms per decode step (ms per output token in brackets for the step total)\n")
    print("| class | method | tokens/step | " + " | ".join(PHASES) + " | step (token) |")
    print("|---|---|---:|" + "---:|" * (len(PHASES) + 1))
    for cls in args.classes.split(","):
        env = class_env(cls)
        for method in args.methods.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", method, "--model", args.model, "--draft",
                                  args.draft, "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)],
                                 env=env, check=True, capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            per = {k: v / got["steps"] * 1e3 for k, v in got["seconds"].items()}
            label = cls if cls != "best" else f"{cpu_isa.detected()} (own)"
            cells = " | ".join(f"{per[p]:.1f}" for p in PHASES)
            print(f"| {label} | {method} | {got['tokens'] / got['steps']:.2f} | {cells} | "
                  f"{got['step_seconds'] / got['steps'] * 1e3:.1f} ({got['step_seconds'] / got['tokens'] * 1e3:.1f}) |",
                  flush=True)


if __name__ == "__main__":
    main()
