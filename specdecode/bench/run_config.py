"""The settings of one `specdecode bench` run (bench/cli.py fills them from the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdecode.bench.datasets import PerTask


@dataclass
class BenchConfig:
    model: str
    methods: list[str]
    out: Path
    draft: str | None = None
    heads: dict[str, str] = field(default_factory=dict)
    """Head directory per kind ("eagle", "medusa") for the head methods."""
    dataset: str = "spec_bench"
    tasks: list[str] | None = None
    per_task: PerTask = None
    limit: int | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    dtype: str = "bf16"
    device: str | None = None
    max_model_len: int | None = None
    peers: list[str] = field(default_factory=list)
    seed: int = 0
    warmup: bool = True
    bandwidth_gb: float = 1.0
    """Size of the bandwidth probe tensor; 0 skips the bandwidth measure and the memory floor."""
    flat_verify_cost: bool = False
    """Our speculative methods size k and their trees as if a target forward of up to a full tree cost as
    much as one token (as on a GPU): τ is then what such hardware would see; tokens/s stay this machine's."""
    plots: bool = True
    progress: bool = True
    round_size: int | None = None
    """Prompts per round: every method runs on one round before the next round starts, so an
    interrupted run loses at most one method's round and every round is measured close in time.
    None = one round of all prompts."""
    resume: bool = False
    """Continue the run stored in ``out`` (records.jsonl + run-state.json), skipping what is done."""
    peer_methods: list[str] | None = None
    """Keep only these peer methods (e.g. hf-plain,hf-assisted); None = all the peers offer."""
    redo: list[str] = field(default_factory=list)
    """With resume: methods whose stored records are dropped and measured again."""
    report_only: bool = False
    """With resume: write the summary and plots of the records so far, measuring nothing."""
    peak_rss_alone: bool = True
    """Measure each plain engine's (ours and llama.cpp's) peak RSS alone, in a child process (`child_rss`)."""
