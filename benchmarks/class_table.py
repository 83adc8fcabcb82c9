"""Speed by CPU class: one `specdecode bench` run per class (the machine's own, and lesser ones forced with
SPECDECODE_ISA), each method against `plain@gguf` of the same run, overall, per dataset and on its worst task.

    python benchmarks/class_table.py bench-out/isa-best bench-out/isa-avx512vnni bench-out/isa-avx2

Each run directory holds the bench's records.jsonl and summary.json (which names the class it ran as). Datasets
as in headline_table.py: MT-bench (its 8 categories), GSM8K, and `code` (HumanEval or the held-out code prompts).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from headline_table import DATASETS, GGUF_PLAIN, Run

from specdecode.bench.run_state import RECORDS_FILE, read_records


def class_of(out: Path) -> str:
    machine = json.loads((out / "summary.json").read_text())["machine"]
    forced = machine.get("isa_forced")
    return f"{machine.get('isa_class')}" + (" (forced)" if forced else " (the CPU's own)")


def ratio(run: Run, method: str, pick: Callable[[str], bool] = lambda task: True) -> float:
    return run.speed(method, pick) / run.speed(GGUF_PLAIN, pick)


def rows(out: Path) -> list[str]:
    run = Run(read_records(out / RECORDS_FILE))
    tasks = sorted({r["task"] for r in run.by_method[GGUF_PLAIN]})
    lines = []
    for method in run.by_method:
        if method == GGUF_PLAIN:
            continue
        by_task = {task: ratio(run, method, lambda x, t=task: x == t) for task in tasks}
        worst = min(by_task, key=by_task.__getitem__)
        cells = [class_of(out), f"`{method}`", f"{run.speed(GGUF_PLAIN):.2f}", f"{run.speed(method):.2f}",
                 f"{ratio(run, method):.2f}×", *(f"{ratio(run, method, pick):.2f}×" for pick in DATASETS.values()),
                 f"{by_task[worst]:.2f}× ({worst})", f"{run.tau(method):.2f}", run.same(method, GGUF_PLAIN)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outs", type=Path, nargs="+", help="bench output directories, one per class")
    args = p.parse_args()
    names = ["MT-bench", "GSM8K", "code"]  # DATASETS' order; "code": HumanEval or held-out code prompts
    head = ["class", "method", "plain tok/s", "tok/s", "× plain", *(f"{name} × plain" for name in names),
            "worst task", "τ", "same tokens as"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if i < 2 or h in ("worst task", "same tokens as") else "---:"
                         for i, h in enumerate(head)) + "|")
    for out in args.outs:
        print("\n".join(rows(out)))


if __name__ == "__main__":
    main()
