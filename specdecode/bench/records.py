"""One timed generation and the record it leaves: a (method, prompt) row of records.jsonl.

Every method, ours and the peers', is timed the same way (`timed`: wall clock around the whole call, prefill
included) and recorded with the same keys; our engine's records add its speculation counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from specdecode.bench.datasets import BenchPrompt

if TYPE_CHECKING:
    from specdecode.engine.llm import LLM
    from specdecode.engine.sequence import RequestOutput
    from specdecode.sampling import SamplingParams

WARMUP_TOKENS = 32
"""Tokens of the warm-up generation after each engine load (enough to reach every code path)."""


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def base_record(method: str, kind: str, prompt: BenchPrompt, ids: list[int], out_ids: list[int],
                seconds: float) -> dict[str, Any]:
    """The keys every engine's record has (`kind`: the engine); ours fill the speculation counters."""
    n = len(out_ids)
    return {
        "method": method, "engine": kind, "task": prompt.task, "prompt_index": prompt.index,
        "source_id": prompt.source_id, "prompt_tokens": len(ids), "output_tokens": n, "seconds": seconds,
        "tokens_per_second": n / seconds if seconds > 0 else 0.0, "prefill_seconds": None, "steps": None,
        "draft_tokens": None, "accepted_tokens": None, "mean_accepted_length": None, "acceptance_rate": None,
        "accepted_by_position": None, "drafted_by_position": None, "draft_seconds": None, "verify_seconds": None,
        "decode_tokens_per_second": None, "finish_reason": None, "token_ids": out_ids,
    }


def generate_ours(llm: LLM, ids: list[int], params: SamplingParams
                  ) -> tuple[RequestOutput, list[int] | None, list[int] | None]:
    """One request through the engine core that also serves (`LLM.run_sequences`, a batch of one):
    (RequestOutput, accepted_by_position, drafted_by_position), the per-position *counts* read from the
    sequence's stats (the public metrics hold the per-position fractions only)."""
    seq = llm.run_sequences([llm.new_sequence(ids, params)])[0]
    return seq.to_output(), list(seq.stats.accepted_by_position), list(seq.stats.drafted_by_position)


def ours_record(method: str, prompt: BenchPrompt, ids: list[int], out: RequestOutput, seconds: float,
                accepted: list[int] | None, drafted: list[int] | None) -> dict[str, Any]:
    rec = base_record(method, "specdecode", prompt, ids, list(out.token_ids), seconds)
    m = out.metrics
    for key in ("prefill_seconds", "steps", "draft_tokens", "accepted_tokens", "mean_accepted_length",
                "acceptance_rate", "draft_seconds", "verify_seconds"):
        rec[key] = m.get(key)
    rec["engine_seconds"] = m.get("seconds")
    rec["accepted_by_position"], rec["drafted_by_position"] = accepted, drafted
    rec["finish_reason"] = out.finish_reason
    prefill = rec["prefill_seconds"]
    decode_seconds = seconds - prefill if prefill is not None else 0.0
    # Decode-only rate (the first token comes from the prefill): what the memory floor bounds.
    rec["decode_tokens_per_second"] = (len(out.token_ids) - 1) / decode_seconds if decode_seconds > 0 else None
    return rec
