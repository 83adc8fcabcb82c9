"""What the benchmark reports about memory: the process's resident set (now, at its peak, and sampled over a
method's run), the bytes an engine's weights and drafting state take, and each plain engine's peak alone."""

from __future__ import annotations

import os
import resource
import sys
import threading
from typing import TYPE_CHECKING

import torch

from specdecode.bench.bandwidth import module_bytes
from specdecode.bench.methods import MethodSpec

if TYPE_CHECKING:
    from specdecode.bench.run_config import BenchConfig
    from specdecode.bench.run_state import RunState
    from specdecode.engine.llm import LLM


def current_rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # Linux fallback
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def process_peak_rss() -> int:
    """Peak RSS of the whole process so far (ru_maxrss; KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


class RssSampler:
    """Peak RSS over a stretch of the run, sampled by a background thread (ru_maxrss never resets)."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak = current_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, current_rss())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())


def engine_memory(llm: LLM) -> dict[str, int]:
    """Bytes of the target's weights and of what speculation adds: the draft model or head (shared target
    tensors not counted) and one request's drafting state (`BatchProposer.state_bytes` of one row)."""
    extra = 0
    if llm.draft is not None:
        extra += module_bytes(llm.draft.model)
    if llm.head is not None:
        extra += module_bytes(llm.head)
    proposer = llm.new_proposer(1)
    if proposer is not None:
        extra += proposer.state_bytes(1)
    return {"target_weight_bytes": module_bytes(llm.target.model), "speculation_bytes": extra}


def measure_alone(state: RunState, cfg: BenchConfig, specs: list[MethodSpec], llamacpp_plain: bool) -> None:
    """Peak RSS of each plain engine alone (ours in each format, llama.cpp's when `llamacpp_plain`), once per
    method, stored in its resources: the first prompt, the run's max tokens, the same context size and threads."""
    from specdecode.bench.child_rss import peak_rss_alone
    from specdecode.engine.llm import DEFAULT_MAX_MODEL_LEN
    from specdecode.fetch import resolve_model
    from specdecode.model.load import read_config

    assert state.prompt_ids is not None
    path = resolve_model(cfg.model)
    n_ctx = min(cfg.max_model_len or DEFAULT_MAX_MODEL_LEN, read_config(path).max_position_embeddings)
    jobs = [(s.name, "specdecode", s.quantization) for s in specs if s.speculative_config is None]
    jobs += [("llamacpp-plain", "llama.cpp", "none")] if llamacpp_plain else []
    for name, engine, quantization in jobs:
        res = state.resources.get(name)
        if res is None or res.get("alone_peak_rss_bytes") is not None:
            continue
        try:
            alone = peak_rss_alone(engine, str(path) if engine == "llama.cpp" else cfg.model, state.prompt_ids[0],
                                   cfg.max_tokens, n_ctx, torch.get_num_threads(), cfg.dtype, quantization)
        except Exception as exc:  # noqa: BLE001 - a missing figure is a note, not a failed run
            state.add_note(f"{name}: peak RSS alone not measured ({type(exc).__name__}: {exc})")
            continue
        state.resources[name] = {**res, "alone_peak_rss_bytes": alone["peak_rss_bytes"]}
    state.save()
