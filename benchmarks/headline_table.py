"""The README's results table from a `specdecode bench` run over MT-bench, GSM8K and HumanEval.

One row per method: mean tokens/s over prompts, its ratio to our plain method and to llama.cpp's plain decoding,
τ (output tokens per target forward), on how many prompts it gives exactly its reference's tokens (our plain
method at the same target format; a peer is compared with the GGUF run at its own quantization, the model it
runs), and per dataset the ratio to plain with τ. Every ratio is a ratio of means within the run.

    python benchmarks/headline_table.py bench-out/headline [--plain plain] [--peer llamaserver-plain]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from specdecode.bench.run_state import RECORDS_FILE, read_records
from specdecode.bench.stats import mean_accepted_length, mean_tokens_per_second

DATASETS: dict[str, Callable[[str], bool]] = {
    "MT-bench": lambda task: task not in ("gsm8k", "code"),  # MT-bench's records carry its category as task
    "GSM8K": lambda task: task == "gsm8k",
    "HumanEval": lambda task: task == "code",
}
GGUF_PLAIN = "plain@gguf"


class Run:
    def __init__(self, records: list[dict]) -> None:
        self.by_method: dict[str, list[dict]] = defaultdict(list)
        for r in records:
            self.by_method[r["method"]].append(r)

    def ours(self, method: str) -> bool:
        return self.by_method[method][0]["engine"] == "specdecode"

    def _rows(self, method: str, dataset: Callable[[str], bool]) -> list[dict]:
        return [r for r in self.by_method[method] if dataset(r["task"])]

    def speed(self, method: str, dataset: Callable[[str], bool] = lambda task: True) -> float:
        speed = mean_tokens_per_second(self._rows(method, dataset))
        assert speed is not None, f"{method} has no records"
        return speed

    def tau(self, method: str, dataset: Callable[[str], bool] = lambda task: True) -> float:
        tau = mean_accepted_length(self._rows(method, dataset))
        assert tau is not None, f"{method} has no steps"
        return tau

    def same(self, method: str, reference: str) -> str:
        def key(r: dict) -> tuple[str, int, str]:
            return r["task"], r["prompt_index"], r["source_id"]

        expected = {key(r): r["token_ids"] for r in self.by_method[reference]}
        rows = self.by_method[method]
        hits = sum(1 for r in rows if expected.get(key(r)) == r["token_ids"])
        return f"`{reference}` {hits}/{len(rows)}"

    def reference(self, method: str, plain: str) -> str | None:
        if method in (plain, GGUF_PLAIN):
            return None
        gguf = "@gguf" in method or not self.ours(method)
        return GGUF_PLAIN if gguf and GGUF_PLAIN in self.by_method else plain


def table(run: Run, plain: str, peer: str) -> list[str]:
    head = ["method", "tok/s", "× plain", f"× {peer}", "τ", "same tokens as",
            *(f"{name} × plain (τ)" for name in DATASETS)]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|---:|---|" + "---:|" * len(DATASETS)]
    for method in run.by_method:
        ours, ref = run.ours(method), run.reference(method, plain)
        cells = [f"`{method}`", f"{run.speed(method):.2f}", f"{run.speed(method) / run.speed(plain):.2f}×",
                 f"{run.speed(method) / run.speed(peer):.2f}×" if peer in run.by_method else "–",
                 f"{run.tau(method):.2f}" if ours else "–", run.same(method, ref) if ref else "–"]
        for dataset in DATASETS.values():
            ratio = f"{run.speed(method, dataset) / run.speed(plain, dataset):.2f}×"
            cells.append(f"{ratio} ({run.tau(method, dataset):.2f})" if ours else ratio)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the bench run's --out directory (records.jsonl)")
    p.add_argument("--plain", default="plain", help="our plain method (the ratios' denominator)")
    p.add_argument("--peer", default="llamaserver-plain", help="the peer method of the llama.cpp column")
    args = p.parse_args()
    print("\n".join(table(Run(read_records(args.out / RECORDS_FILE)), args.plain, args.peer)))


if __name__ == "__main__":
    main()
