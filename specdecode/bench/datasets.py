"""Evaluation prompts: Spec-Bench, HumanEval, GSM8K, MT-bench, or any JSONL file.

Each prompt becomes one chat message (the target's chat template is applied later, by the
harness). Data files live in ``benchmarks/data/<name>/`` of the repository; when that folder
is missing (an installed package), ``../shared/data`` beside the repository is tried, then
``$SPECDECODE_BENCH_DATA``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASET_FILES = {
    "spec_bench": "spec_bench/question.jsonl",
    "humaneval": "humaneval/HumanEval.jsonl",
    "gsm8k": "gsm8k/test.jsonl",
    "mt_bench": "mt_bench/question.jsonl",
}
DATASETS: tuple[str, ...] = tuple(DATASET_FILES)

# Spec-Bench's six tasks: its 80 MT-bench questions (8 categories of 10) count as one task.
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}\n```"


@dataclass(frozen=True)
class BenchPrompt:
    task: str
    """Task the prompt is reported under (Spec-Bench task, "code", "gsm8k", or the file's category)."""
    index: int
    """Position of the prompt within its task in this run (0-based)."""
    messages: list[dict[str, str]] = field(hash=False)
    """The chat conversation sent to the target (one user message)."""
    source_id: str = ""
    """The dataset's own id (question_id, task_id, line number)."""
    category: str = ""
    """The dataset's finer category where it has one (MT-bench's 8 categories)."""


def data_roots() -> list[Path]:
    """Folders searched for dataset files, in order."""
    repo = Path(__file__).resolve().parents[2]
    roots = [repo / "benchmarks" / "data", repo.parent / "shared" / "data"]
    env = os.environ.get("SPECDECODE_BENCH_DATA")
    if env:
        roots.insert(0, Path(env))
    return roots


def dataset_path(name: str) -> Path:
    """The JSONL file of a named dataset, or ``name`` itself if it is a path to a file."""
    if name in DATASET_FILES:
        for root in data_roots():
            p = root / DATASET_FILES[name]
            if p.is_file():
                return p
        searched = ", ".join(str(r / DATASET_FILES[name]) for r in data_roots())
        raise ValueError(f"dataset {name!r} not found; searched {searched}")
    p = Path(name)
    if p.is_file():
        return p
    raise ValueError(f"unknown dataset {name!r}: use one of {', '.join(DATASETS)} or a path to a .jsonl file")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
    return rows


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _from_row(kind: str, row: dict[str, Any], lineno: int) -> tuple[str, list[dict[str, str]], str, str]:
    """(task, messages, source_id, category) of one JSONL row."""
    if kind == "humaneval":
        return "code", _user(HUMANEVAL_TEMPLATE.format(prompt=row["prompt"])), str(row.get("task_id", lineno)), ""
    if kind == "gsm8k":
        # Its own task name: MT-bench has a "math" category too, and joined datasets group by task.
        return "gsm8k", _user(row["question"]), str(lineno), ""
    category = str(row.get("category") or row.get("task") or "default")
    source_id = str(row.get("question_id", row.get("id", row.get("task_id", lineno))))
    if "messages" in row:
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    elif "turns" in row:
        messages = _user(row["turns"][0])  # first turn only (single-turn protocol)
    elif "prompt" in row:
        messages = _user(row["prompt"])
    elif "question" in row:
        messages = _user(row["question"])
    else:
        raise ValueError(f"line {lineno}: expected one of messages, turns, prompt, question; got {sorted(row)}")
    task = "mt_bench" if kind == "spec_bench" and category in MT_BENCH_CATEGORIES else category
    return task, messages, source_id, category


PerTask = int | Mapping[str, int] | None
"""First N prompts of each task: one N for all, or N per task name with "*" as the default."""


def parse_per_task(text: str) -> PerTask:
    """``"10"`` -> 10; ``"10,code=40"`` -> {"*": 10, "code": 40} (a task without an entry keeps all)."""
    counts: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, value = part.rpartition("=")
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"--per-task: expected N or TASK=N, got {part!r}") from None
        if n < 1:
            raise ValueError(f"--per-task: counts must be >= 1, got {part!r}")
        counts[name or "*"] = n
    if not counts:
        raise ValueError("--per-task: empty")
    return counts["*"] if list(counts) == ["*"] else counts


def _task_count(per_task: PerTask, task: str) -> int | None:
    if per_task is None or isinstance(per_task, int):
        return per_task
    return per_task.get(task, per_task.get("*"))


def _dataset_rows(dataset: str) -> list[tuple[str, list[dict[str, str]], str, str]]:
    """Rows of one dataset, or of several joined with "+" (e.g. ``spec_bench+humaneval``)."""
    rows = []
    for name in dataset.split("+") if "+" in dataset and not Path(dataset).is_file() else [dataset]:
        kind = name if name in DATASET_FILES else "jsonl"
        rows += [_from_row(kind, row, i) for i, row in enumerate(read_jsonl(dataset_path(name)))]
    return rows


def load_prompts(
    dataset: str,
    tasks: list[str] | None = None,
    per_task: PerTask = None,
    limit: int | None = None,
) -> list[BenchPrompt]:
    """Prompts of a dataset (or datasets joined with "+"), grouped by task (tasks in file order,
    or in the order of ``tasks``).

    ``tasks`` keeps only those tasks (a name matches a task or a finer category, so
    ``--tasks coding`` selects MT-bench's coding questions of Spec-Bench); ``per_task`` keeps
    the first N of each task (see `PerTask`); ``limit`` keeps the first N prompts overall after that.
    """
    rows = _dataset_rows(dataset)
    wanted = list(dict.fromkeys(tasks)) if tasks else None
    grouped: dict[str, list[tuple[str, list[dict[str, str]], str, str]]] = {}
    for row in rows:
        task, _, _, category = row
        if wanted is None:
            grouped.setdefault(task, []).append(row)
            continue
        name = task if task in wanted else (category if category in wanted else None)
        if name is not None:
            grouped.setdefault(name, []).append(row)
    if wanted is not None:
        missing = [t for t in wanted if t not in grouped]
        if missing:
            available = sorted({r[0] for r in rows} | {r[3] for r in rows if r[3]})
            raise ValueError(f"no prompts for tasks {missing} in {dataset}; available: {', '.join(available)}")
        grouped = {t: grouped[t] for t in wanted}
    prompts: list[BenchPrompt] = []
    for task, trows in grouped.items():
        n = _task_count(per_task, task)
        for i, (_, messages, source_id, category) in enumerate(trows[:n] if n else trows):
            prompts.append(BenchPrompt(task, i, messages, source_id, category))
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise ValueError(f"no prompts selected from {dataset}")
    return prompts
