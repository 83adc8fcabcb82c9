"""Diagnosing load-aware drafting and chunked prefill: with SPECDECODE_STEP_LOG set to a file, the engine
appends one JSON line per batch step (wall-clock time, rows, chosen k, drafted nodes, node budget and phase
seconds)."""

from __future__ import annotations

import json
import os
import time

STEP_LOG = os.environ.get("SPECDECODE_STEP_LOG")


def log_step(ks: list[int], drafted: list[int], node_budget: int, draft_seconds: float, admit_seconds: float,
             step_seconds: float) -> None:
    if STEP_LOG is not None:
        with open(STEP_LOG, "a") as f:
            f.write(json.dumps({"t": round(time.time(), 3), "rows": len(ks), "ks": ks, "drafted": drafted,
                                "node_budget": node_budget,
                                "draft_s": round(draft_seconds, 4), "admit_s": round(admit_seconds, 4),
                                "step_s": round(step_seconds, 4)}) + "\n")
