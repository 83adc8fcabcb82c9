"""benchmarks/headline_table.py: the README's results table from a bench run's records."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "headline_table", Path(__file__).resolve().parents[1] / "benchmarks" / "headline_table.py")
assert _spec is not None and _spec.loader is not None
headline_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(headline_table)


def _record(method: str, task: str, tps: float, steps: int, ids: list[int], engine: str = "specdecode") -> dict:
    return {"method": method, "engine": engine, "task": task, "prompt_index": 0, "source_id": task,
            "tokens_per_second": tps, "output_tokens": len(ids), "steps": steps, "token_ids": ids}


def test_ratios_are_ratios_of_means_and_references_follow_the_format() -> None:
    records = []
    for task, speed in (("writing", 4.0), ("gsm8k", 6.0), ("code", 8.0)):
        records += [
            _record("plain", task, speed, 4, [1, 2, 3, 4]),
            _record("eagle", task, 2 * speed, 2, [1, 2, 3, 4]),
            _record("plain@gguf", task, 3 * speed, 4, [1, 2, 3, 5]),
            _record("eagle@gguf", task, 4 * speed, 1, [1, 2, 3, 5] if task != "code" else [9, 9, 9, 9]),
            _record("llamacpp-plain", task, 1.5 * speed, 0, [1, 2, 3, 5], engine="llama.cpp"),
        ]
    lines = headline_table.table(headline_table.Run(records), "plain", "llamacpp-plain")
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[2:]]
    rows = {row[0].strip("`"): row for row in cells}
    assert rows["plain"][1:6] == ["6.00", "1.00×", "0.67×", "1.00", "–"]
    assert rows["eagle"][1:6] == ["12.00", "2.00×", "1.33×", "2.00", "`plain` 3/3"]
    assert rows["eagle@gguf"][5] == "`plain@gguf` 2/3"  # at the GGUF's quantization: compared with its plain run
    assert rows["llamacpp-plain"][4:6] == ["–", "`plain@gguf` 3/3"]  # a peer runs the GGUF file
    assert rows["eagle@gguf"][6:] == ["4.00× (4.00)"] * 3
