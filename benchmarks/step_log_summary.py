"""Where a served pass's time went, by batch step: a server's SPECDECODE_STEP_LOG split by the passes of a
`serve_load.py` run (each pass records its wall-clock window), and each pass's steps grouped by their rows and
the most nodes any row drafted.

    SPECDECODE_STEP_LOG=steps.jsonl python benchmarks/serve_load.py ... --out OUT
    python benchmarks/step_log_summary.py OUT/results.json steps.jsonl [--concurrency 4] [--min-steps 3]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="serve_load.py's results.json")
    ap.add_argument("steps", type=Path, help="the server's SPECDECODE_STEP_LOG file")
    ap.add_argument("--concurrency", type=int, default=None, help="only this concurrency's passes")
    ap.add_argument("--min-steps", type=int, default=3, help="leave out groups of fewer steps")
    args = ap.parse_args()
    steps = [json.loads(line) for line in args.steps.read_text().splitlines() if line.strip()]
    for row in json.loads(args.results.read_text())["rows"]:
        if args.concurrency is not None and row["concurrency"] != args.concurrency:
            continue
        for start, end in row.get("windows", [row["window"]]):
            in_pass = [s for s in steps if start <= s["t"] <= end]
            groups: dict[tuple[int, int], list[float]] = defaultdict(list)
            admits: dict[tuple[int, int], int] = defaultdict(int)
            for s in in_pass:
                key = (s["rows"], max(s["drafted"], default=0))
                groups[key].append(s["step_s"])
                admits[key] += s["admit_s"] > 0.001
            print(f"concurrency {row['concurrency']} {row['mode']}: {end - start:.1f} s, {len(in_pass)} steps, "
                  f"{sum(s['step_s'] for s in in_pass):.1f} s in steps")
            for (rows, drafted), seconds in sorted(groups.items()):
                if len(seconds) >= args.min_steps:
                    print(f"  {rows:2d} rows, most drafted {drafted:2d}: {len(seconds):4d} steps, "
                          f"{1000 * sum(seconds) / len(seconds):6.1f} ms each, {sum(seconds):5.1f} s, "
                          f"{admits[(rows, drafted)]} with an admission")


if __name__ == "__main__":
    main()
