"""Total throughput of the Ray Serve cluster with 1 and 2 engine replicas, against the plain server.

Runs, one after the other, on this machine: `specdecode serve` (the plain server, `OMP_NUM_THREADS` =
--replica-threads), then `python -m specdecode.cluster --replicas 1` and `--replicas 2` (one engine of
--replica-threads threads per replica). Each setup gets the same prompts from --concurrency closed-loop
streaming clients (after a warm-up request); the script reports total output tokens/s, p50 latency and
time to first token, the Ray path's overhead at one replica (plain tok/s / ray-1 tok/s - 1), the
2-replica speedup, and whether every setup produced the same texts (greedy decoding: it must).

Example (the full benchmark)::

    python benchmarks/cluster_load.py --model smollm2-135m-instruct --dtype fp32 --method ngram \\
        --num-prompts 48 --max-tokens 128 --concurrency 16 --out bench-out/cluster_load

Short run::

    python benchmarks/cluster_load.py --model smollm2-135m-instruct --dtype fp32 --method ngram \\
        --num-prompts 4 --max-tokens 16 --concurrency 4 --setups plain,ray-1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from serve_load import run_level  # noqa: E402

from specdecode.bench.datasets import DATASETS, load_prompts  # noqa: E402
from specdecode.bench.process import free_port  # noqa: E402
from specdecode.cli_args import add_model_args  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--setups", default="plain,ray-1,ray-2", help="comma list of plain, ray-N (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients (default: %(default)s)")
    p.add_argument("--dataset", default="spec_bench", help=f"one of {', '.join(DATASETS)} or a .jsonl path")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--replica-threads", type=int, default=1, help="threads of each engine (plain server too)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="batch rows per engine (default: --concurrency)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    return p.parse_args(argv)


def _model_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model, "--dtype", args.dtype]
    for flag, value in (("--device", args.device), ("--max-model-len", args.max_model_len),
                        ("--speculative-config", args.speculative_config), ("--draft", args.draft),
                        ("--method", args.method), ("--num-speculative-tokens", args.num_speculative_tokens),
                        ("--quantization", args.quantization)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def start(setup: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    rows = args.max_num_seqs or args.concurrency
    common = [*_model_flags(args), "--port", str(port), "--max-num-seqs", str(rows), "--max-waiting",
              str(4 * args.concurrency), "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_USAGE_STATS_ENABLED": "0"}
    replicas = 0
    if setup == "plain":
        env["OMP_NUM_THREADS"] = str(args.replica_threads)
        cmd = [sys.executable, "-m", "specdecode.cli", "serve", *common]
    elif setup.startswith("ray-"):
        replicas = int(setup.split("-", 1)[1])
        cmd = [sys.executable, "-m", "specdecode.cluster", *common, "--replicas", str(replicas),
               "--replica-threads", str(args.replica_threads), "--route-saturation", str(rows)]
    else:
        raise SystemExit(f"unknown setup {setup!r}: plain or ray-N")
    print("starting:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{setup} exited with code {proc.returncode}")
        try:
            if replicas:
                infos = httpx.get(url + "/cluster/replicas", timeout=30).json()["replicas"]
                if sum(i["healthy"] for i in infos) == replicas:
                    return proc, url
            elif httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1)
    stop(proc)
    raise TimeoutError(f"{setup} did not become ready")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"Cluster load: {args.model}, {args.num_prompts} prompts x {args.max_tokens} tokens, "
             f"{args.concurrency} streaming clients, {args.replica_threads} thread(s) per engine", "",
             "| setup | tok/s | p50 latency (s) | p50 TTFT (s) | tau | same texts as first |",
             "|---|---:|---:|---:|---:|:---:|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['tokens_per_second']:.1f} | {r['latency_p50']:.2f} | {r['ttft_p50']:.2f} "
                     f"| {r['mean_accepted_length']:.2f} | {'yes' if r['same_texts'] else 'no'} |")
    by = {r["setup"]: r for r in rows}
    if "plain" in by and "ray-1" in by:
        lines.append(f"\nRay path overhead at one replica: "
                     f"{by['plain']['tokens_per_second'] / by['ray-1']['tokens_per_second'] - 1:+.1%} "
                     "(plain tok/s over ray-1 tok/s, minus 1)")
    if "ray-1" in by and "ray-2" in by:
        speedup = by["ray-2"]["tokens_per_second"] / by["ray-1"]["tokens_per_second"]
        lines.append(f"2 replicas / 1 replica: {speedup:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.concurrency < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        raise SystemExit("--concurrency, --num-prompts and --max-tokens must be positive")
    prompts = [p.messages for p in load_prompts(args.dataset)]
    prompts = (prompts * (args.num_prompts // len(prompts) + 1))[: args.num_prompts]
    rows: list[dict[str, Any]] = []
    for setup in [s.strip() for s in args.setups.split(",") if s.strip()]:
        proc, url = start(setup, args)
        try:
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            run_level(url, {}, model, prompts[:1], 1, args, plain=False)  # warm-up, excluded
            row = run_level(url, {}, model, prompts, args.concurrency, args, plain=False)
        finally:
            stop(proc)
        row["setup"] = setup
        row["same_texts"] = not rows or row["texts"] == rows[0]["texts"]
        rows.append(row)
        print(f"{setup:<6} {row['tokens_per_second']:8.1f} tok/s ({row['output_tokens']} tokens in "
              f"{row['seconds']:.1f}s, p50 latency {row['latency_p50']:.2f}s)", file=sys.stderr)
    report = markdown(rows, args)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                           "rows": rows}, indent=1))
        (args.out / "results.md").write_text(report + "\n")
    return 0 if all(r["same_texts"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
