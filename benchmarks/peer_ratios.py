"""Per-dataset speed ratios of a `specdecode bench` run against its peers' best method, from its records.

A run over several datasets (e.g. ``--dataset spec_bench+humaneval --per-task 10,code=20``) is split by dataset
(HumanEval's task is ``code``; every other task is Spec-Bench's); for each dataset and method: mean tokens/s over
prompts, the ratio to the best peer method of that dataset and to a named plain method, and how many prompts give
exactly the reference method's tokens. An answer ends at its first end-of-turn token (the run's EOS): a record
holding tokens after it is counted up to it.

    python benchmarks/peer_ratios.py bench-out/gguf-vs-llamacpp [--plain plain@gguf] [--peer-prefix llamaserver-]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from specdecode.bench.run_state import RECORDS_FILE, read_records


def dataset_of(record: dict) -> str:
    return "HumanEval" if record["task"] == "code" else "Spec-Bench"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the bench run's --out directory (records.jsonl)")
    p.add_argument("--plain", default="plain@gguf", help="our plain method (the reference for identical output)")
    p.add_argument("--peer-prefix", default="llamaserver-", help="peer methods: names starting with this")
    args = p.parse_args()
    records = read_records(args.out / RECORDS_FILE)
    eos = json.loads((args.out / "run-state.json").read_text()).get("eos_token_id")
    speed: dict[tuple[str, str], list[float]] = defaultdict(list)
    tokens: dict[tuple[str, str, str], list[int]] = {}
    for r in records:
        ids = r["token_ids"]
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
        speed[(dataset_of(r), r["method"])].append(len(ids) / r["seconds"])
        tokens[(dataset_of(r), r["method"], f'{r["task"]}/{r["source_id"]}')] = ids
    for dataset in sorted({d for d, _ in speed}):
        methods = [m for d, m in speed if d == dataset]
        mean = {m: statistics.fmean(speed[(dataset, m)]) for m in methods}
        peers = [m for m in methods if m.startswith(args.peer_prefix)]
        best = max(peers, key=mean.__getitem__) if peers else None
        print(f"\n{dataset} ({len(speed[(dataset, methods[0])])} prompts); best peer: {best}")
        print(f"| method | tok/s | × best peer | × {args.plain} | same tokens as {args.plain} |")
        print("|---|---:|---:|---:|---:|")
        for m in sorted(methods, key=lambda m: (m.startswith(args.peer_prefix), -mean[m])):
            keys = [k for k in tokens if k[0] == dataset and k[1] == m]
            same = sum(tokens.get((dataset, args.plain, k[2])) == tokens[k] for k in keys)
            vs_peer = f"{mean[m] / mean[best]:.2f}×" if best else "–"
            vs_plain = f"{mean[m] / mean[args.plain]:.2f}×" if args.plain in mean else "–"
            print(f"| `{m}` | {mean[m]:.2f} | {vs_peer} | {vs_plain} | {same}/{len(keys)} |")


if __name__ == "__main__":
    main()
