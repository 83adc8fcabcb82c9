"""Benchmark statistics: pure functions over lists of per-prompt record dicts.

A record is one (method, prompt) run. The keys used here (all written by the harness):

- ``method``, ``task``, ``prompt_index``
- ``output_tokens``, ``seconds``, ``tokens_per_second`` (= output_tokens / seconds, prefill included)
- ``steps``, ``draft_tokens``, ``accepted_tokens`` (``None`` where the engine does not say, e.g. peers)
- ``accepted_by_position`` / ``drafted_by_position``: per-position counts (lists of ints) or ``None``
- ``draft_seconds``, ``verify_seconds`` (``None`` where unknown)
- ``token_ids``: the generated ids

Words as in the glossary of docs/design.md: τ (mean accepted length) = output tokens / steps, acceptance
rate = accepted / draft tokens, speedup = mean tokens/s of the method ÷ mean tokens/s of the
baseline over the same prompts (Spec-Bench's ratio of means, never a mean of per-prompt ratios).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

Record = dict[str, Any]

OVERALL = "overall"


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _sum_known(records: Iterable[Record], key: str) -> float | None:
    """Sum of ``key`` over records, or None if any record lacks it (unknown for that engine)."""
    total = 0.0
    seen = False
    for r in records:
        v = r.get(key)
        if v is None:
            return None
        total += v
        seen = True
    return total if seen else None


def mean_tokens_per_second(records: Sequence[Record]) -> float | None:
    """Mean over prompts of per-prompt tokens/s (None for no records)."""
    return _mean([float(r["tokens_per_second"]) for r in records])


def mean_decode_tokens_per_second(records: Sequence[Record]) -> float | None:
    """Mean over prompts of decode-only tokens/s (prefill excluded), over the prompts that have one
    (a prompt that stopped after its first token has no decode phase); None if none has."""
    return _mean([float(r["decode_tokens_per_second"]) for r in records if r.get("decode_tokens_per_second")])


def speedup(records: Sequence[Record], baseline: Sequence[Record]) -> float | None:
    """Ratio of means: mean tokens/s of ``records`` ÷ mean tokens/s of ``baseline``."""
    num, den = mean_tokens_per_second(records), mean_tokens_per_second(baseline)
    if num is None or not den:
        return None
    return num / den


def mean_accepted_length(records: Sequence[Record]) -> float | None:
    """τ = Σ output tokens / Σ steps; None when steps are unknown or zero."""
    steps = _sum_known(records, "steps")
    if not steps:
        return None
    return sum(r["output_tokens"] for r in records) / steps


def acceptance_rate(records: Sequence[Record]) -> float | None:
    """Σ accepted / Σ draft tokens; None when unknown or nothing was drafted."""
    drafted = _sum_known(records, "draft_tokens")
    accepted = _sum_known(records, "accepted_tokens")
    if not drafted or accepted is None:
        return None
    return accepted / drafted


def position_counts(records: Sequence[Record]) -> tuple[list[int], list[int]] | None:
    """(accepted, drafted) counts per draft position, summed over records; None if unknown."""
    accepted: list[int] = []
    drafted: list[int] = []
    for r in records:
        a, d = r.get("accepted_by_position"), r.get("drafted_by_position")
        if a is None or d is None:
            return None
        for dst, src in ((accepted, a), (drafted, d)):
            if len(src) > len(dst):
                dst.extend([0] * (len(src) - len(dst)))
            for i, v in enumerate(src):
                dst[i] += int(v)
    n = max(len(accepted), len(drafted))
    accepted.extend([0] * (n - len(accepted)))
    drafted.extend([0] * (n - len(drafted)))
    return accepted, drafted


def acceptance_by_position(records: Sequence[Record]) -> list[float] | None:
    """[i] = Σ accepted at position i ÷ Σ drafted at position i (from summed counts)."""
    counts = position_counts(records)
    if counts is None:
        return None
    return [a / d if d else 0.0 for a, d in zip(*counts, strict=True)]


def prompt_key(record: Record) -> tuple[str, int]:
    return (str(record["task"]), int(record["prompt_index"]))


def identical_rate(records: Sequence[Record], baseline: Sequence[Record]) -> float | None:
    """Fraction of ``records`` whose token_ids equal the baseline's for the same prompt.

    Prompts the baseline did not run are left out; None when no prompt is shared.
    """
    base = {prompt_key(r): r.get("token_ids") for r in baseline}
    shared = [r for r in records if prompt_key(r) in base]
    if not shared:
        return None
    same = sum(1 for r in shared if r.get("token_ids") is not None and r["token_ids"] == base[prompt_key(r)])
    return same / len(shared)


def group_by(records: Iterable[Record], key: str | Callable[[Record], Any]) -> dict[Any, list[Record]]:
    """Records grouped by a key (first-seen order)."""
    get = (lambda r: r[key]) if isinstance(key, str) else key
    out: dict[Any, list[Record]] = {}
    for r in records:
        out.setdefault(get(r), []).append(r)
    return out


def aggregate(
    records: Sequence[Record],
    baseline: Sequence[Record] | None = None,
    own_baseline: Sequence[Record] | None = None,
) -> dict[str, Any]:
    """All statistics of one group of records (one method, one task or overall).

    ``baseline`` gives speedup and identical-output rate (our ``plain``); ``own_baseline``
    gives the same against a peer's own plain run (e.g. hf-assisted vs hf-plain).
    """
    counts = position_counts(records)
    out: dict[str, Any] = {
        "prompts": len(records),
        "output_tokens": sum(int(r["output_tokens"]) for r in records),
        "seconds": sum(float(r["seconds"]) for r in records),
        "tokens_per_second": mean_tokens_per_second(records),
        "decode_tokens_per_second": mean_decode_tokens_per_second(records),
        "speedup": speedup(records, baseline) if baseline else None,
        "mean_accepted_length": mean_accepted_length(records),
        "acceptance_rate": acceptance_rate(records),
        "acceptance_by_position": acceptance_by_position(records),
        "accepted_by_position": counts[0] if counts else None,
        "drafted_by_position": counts[1] if counts else None,
        "draft_seconds": _sum_known(records, "draft_seconds"),
        "verify_seconds": _sum_known(records, "verify_seconds"),
        "identical_rate": identical_rate(records, baseline) if baseline else None,
    }
    if own_baseline is not None:
        out["speedup_vs_own_plain"] = speedup(records, own_baseline)
        out["identical_rate_vs_own_plain"] = identical_rate(records, own_baseline)
    return out


def complete_prompts(records: Sequence[Record]) -> tuple[list[Record], int]:
    """Records of the prompts every method measured, and how many such prompts there are. Means over
    different prompt sets are not comparable, so an unfinished run is summarized on its common part."""
    methods = {r["method"] for r in records}
    seen: dict[tuple[str, int], set[str]] = {}
    for r in records:
        seen.setdefault((r["task"], r["prompt_index"]), set()).add(r["method"])
    complete = {k for k, ms in seen.items() if ms == methods}
    return [r for r in records if (r["task"], r["prompt_index"]) in complete], len(complete)


def summarize(
    records: Sequence[Record],
    baseline_method: str = "plain",
    own_baselines: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Per method: per task and overall statistics.

    Returns ``{"methods": [...], "tasks": [...], "by_method": {method: {"overall": {...},
    "tasks": {task: {...}}}}}``. Speedup and identical rate are taken against the baseline
    method's records of the same task (overall: all of them). ``own_baselines`` maps a peer
    method to its own plain method (``{"hf-assisted": "hf-plain"}``).
    """
    by_method = group_by(records, "method")
    tasks = list(group_by(records, "task"))
    base_all = by_method.get(baseline_method, [])
    base_by_task = group_by(base_all, "task")
    own_baselines = own_baselines or {}
    out: dict[str, Any] = {"baseline": baseline_method, "methods": list(by_method), "tasks": tasks, "by_method": {}}
    for method, recs in by_method.items():
        own_name = own_baselines.get(method)
        own_all = by_method.get(own_name, []) if own_name else None
        own_by_task = group_by(own_all, "task") if own_all is not None else {}
        per_task = {}
        for task, trecs in group_by(recs, "task").items():
            per_task[task] = aggregate(
                trecs, base_by_task.get(task), own_by_task.get(task) if own_all is not None else None
            )
        out["by_method"][method] = {"overall": aggregate(recs, base_all, own_all), "tasks": per_task}
    return out
