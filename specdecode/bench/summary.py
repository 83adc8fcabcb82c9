"""The run's summary: per-method statistics of the complete prompts, resources, memory floors, the protocol and
the machine (what summary.json holds and summary.md renders)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from specdecode.bench import stats
from specdecode.bench.bandwidth import memory_floor
from specdecode.bench.datasets import BenchPrompt
from specdecode.bench.memory import process_peak_rss
from specdecode.bench.records import WARMUP_TOKENS
from specdecode.bench.run_config import BenchConfig
from specdecode.bench.run_state import RunState


def _baseline(methods: set[str]) -> str:
    """What speedups are measured against: `plain`, or the one plain@FORMAT of a run without it."""
    formatted = sorted(m for m in methods if m.startswith("plain@"))
    return formatted[0] if "plain" not in methods and len(formatted) == 1 else "plain"


def _own_baselines(methods: set[str]) -> dict[str, str]:
    """A peer's speculative method -> that peer's plain method (its speedup is measured against it)."""
    own = {}
    for m in methods:
        for prefix in ("hf-", "llamacpp-"):
            if m.startswith(prefix) and m != prefix + "plain" and prefix + "plain" in methods:
                own[m] = prefix + "plain"
    return own


def _memory_floors(state: RunState, summary: dict[str, Any], bandwidth: dict[str, Any] | None
                   ) -> dict[str, dict[str, Any]]:
    """Per plain method: the tokens/s that reading its weights once per token at the probed bandwidth allows, and
    the fraction of it the method reached."""
    floors = {}
    for method, info in state.plain_weights.items():
        if bandwidth is None or not info["bytes"] or method not in summary["by_method"]:
            continue
        floor_tps = memory_floor(bandwidth["read_gb_per_s"], info["bytes"])
        overall = summary["by_method"][method]["overall"]
        plain, plain_decode = overall.get("tokens_per_second"), overall.get("decode_tokens_per_second")
        floors[method] = {
            "weight_bytes_per_token": info["bytes"],
            "embedding_bytes_excluded": info["embedding_bytes_excluded"],
            "weight_bytes_by_module_type": info["by_module_type"],
            "bandwidth_gb_per_s": bandwidth["read_gb_per_s"],
            "floor_tokens_per_second": floor_tps,
            "plain_tokens_per_second": plain,
            "plain_fraction_of_floor": plain / floor_tps if plain is not None and floor_tps else None,
            "plain_decode_tokens_per_second": plain_decode,
            "plain_decode_fraction_of_floor": plain_decode / floor_tps if plain_decode and floor_tps else None,
        }
    return floors


def build_summary(cfg: BenchConfig, state: RunState, prompts: list[BenchPrompt],
                  bandwidth: dict[str, Any] | None) -> dict[str, Any]:
    """The summary of the prompts every method measured (a partial run says so in its notes)."""
    records, complete = stats.complete_prompts(state.records)
    notes = list(state.notes)
    if complete < len(prompts):
        notes.append(f"partial run: {complete} of {len(prompts)} prompts were measured by every method, and "
                     "only those are summarized; rerun the command with --resume to continue")
    methods = {r["method"] for r in records}
    summary = stats.summarize(records, _baseline(methods), _own_baselines(methods))
    for method, res in state.resources.items():
        if method in summary["by_method"]:
            summary["by_method"][method]["resources"] = res
    floors = _memory_floors(state, summary, bandwidth)
    config = asdict(cfg)
    config["out"] = str(cfg.out)
    first = state.sessions[0]  # the run's command and machine: the session that started it
    return {
        "command": first["command"],
        "machine": {k: v for k, v in first.items() if k not in ("command", "records_before")},
        "sessions": [{k: s.get(k) for k in ("date", "cpu", "git_commit", "command", "records_before")}
                     for s in state.sessions],
        "config": config,
        "protocol": ("greedy" if cfg.temperature <= 0 else f"temperature {cfg.temperature}")
        + f", batch 1, one {WARMUP_TOKENS}-token warm-up generation per engine load excluded, prefill "
        "included in each prompt's time, tokens/s = output tokens / seconds per prompt, speedup = ratio of "
        "means vs plain, stop at EOS"
        + (f", methods run in rounds of {cfg.round_size} prompts" if cfg.round_size else ""),
        "num_prompts": len(prompts),
        "num_prompts_complete": complete,
        "prompt_tokens_total": sum(len(i) for i in state.prompt_ids or []),
        "bandwidth": bandwidth,
        "memory_floor": floors.get("plain"),
        "memory_floors": floors,
        "process_peak_rss_bytes": process_peak_rss(),
        "notes": notes,
        **summary,
    }
