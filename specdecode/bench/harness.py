"""The benchmark run: methods × prompts, Spec-Bench protocol, records and summary.

Protocol (Spec-Bench): greedy by default, batch 1, one warm-up generation per method that
is not counted, each prompt's time includes its prefill, per-prompt tokens/s = output
tokens / seconds, generation stops at EOS as a user's would (``ignore_eos`` off). Every
method (ours and peers) gets the same prompt token ids (the target's chat template) and the
same max tokens. One engine object is built per method, reused over all prompts and freed
before the next is built.
"""

from __future__ import annotations

import gc
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from specdecode.bench import stats
from specdecode.bench.bandwidth import (
    measure_bandwidth,
    median_probe,
    memory_floor,
    module_bytes,
    weight_bytes_per_token,
)
from specdecode.bench.datasets import BenchPrompt, PerTask, load_prompts
from specdecode.bench.methods import MethodSpec, parse_method
from specdecode.bench.peers import PeerContext, make_peers, parse_peers
from specdecode.bench.run_state import RunState


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
    peak_rss_alone: bool = True
    """Measure each plain engine's (ours and llama.cpp's) peak RSS alone, in a child process (`child_rss`)."""
    """With resume: write the summary and plots of the records so far, measuring nothing."""


# ---- memory --------------------------------------------------------------------------------------


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


# ---- machine -------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        repo = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    import specdecode

    info: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "specdecode": specdecode.__version__,
        "git_commit": _git_commit(),
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    for mod in ("transformers", "llama_cpp"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: just not reported
            info[mod] = None
    return info


# ---- one method ----------------------------------------------------------------------------------


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="prompt", disable=not enabled, dynamic_ncols=True)


def _base_record(method: str, kind: str, prompt: BenchPrompt, ids: list[int], out_ids: list[int],
                 seconds: float) -> dict[str, Any]:
    n = len(out_ids)
    return {
        "method": method, "engine": kind, "task": prompt.task, "prompt_index": prompt.index,
        "source_id": prompt.source_id, "prompt_tokens": len(ids), "output_tokens": n, "seconds": seconds,
        "tokens_per_second": n / seconds if seconds > 0 else 0.0, "prefill_seconds": None, "steps": None,
        "draft_tokens": None, "accepted_tokens": None, "mean_accepted_length": None, "acceptance_rate": None,
        "accepted_by_position": None, "drafted_by_position": None, "draft_seconds": None, "verify_seconds": None,
        "decode_tokens_per_second": None, "finish_reason": None, "token_ids": out_ids,
    }


def _generate_ours(llm: Any, ids: list[int], params: Any) -> tuple[Any, list[int] | None, list[int] | None]:
    """One request through the engine core that also serves (`LLM.run_sequences`, a batch of one):
    (RequestOutput, accepted_by_position, drafted_by_position), the per-position *counts* read from the
    sequence's stats (the public metrics hold the per-position fractions only)."""
    seq = llm.run_sequences([llm.new_sequence(ids, params)])[0]
    return seq.to_output(), list(seq.stats.accepted_by_position), list(seq.stats.drafted_by_position)


def _engine_memory(llm: Any) -> dict[str, int]:
    """Bytes of the target's weights and of what speculation adds: the draft model or head (shared
    target tensors not counted) and the proposer's own caches (draft KV cache, head features)."""
    extra = 0
    if llm.draft is not None:
        extra += module_bytes(llm.draft.model)
    if llm.head is not None:
        extra += module_bytes(llm.head)
    proposer = llm.new_proposer(1)
    if proposer is not None:  # one request's drafting state: its row of the draft's or head's cache, head features
        from specdecode.proposers.base import SequenceView
        from specdecode.sampling import SamplingParams

        proposer.reserve(1)
        proposer.begin(0, SequenceView([0, 0], 1, SamplingParams(), torch.Generator()))
        rows = getattr(proposer, "cache", None)  # a RowCache (batch proposers with a KV cache of their own)
        if rows is not None and rows.cache is not None:
            extra += rows.cache.nbytes()
        extra += sum(t.nbytes for t in getattr(proposer, "features", {}).values())
    return {"target_weight_bytes": module_bytes(llm.target.model), "speculation_bytes": extra}


def _ours_record(method: str, prompt: BenchPrompt, ids: list[int], out: Any, seconds: float,
                 accepted: list[int] | None, drafted: list[int] | None) -> dict[str, Any]:
    rec = _base_record(method, "specdecode", prompt, ids, list(out.token_ids), seconds)
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


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


WARMUP_TOKENS = 32
"""Tokens of the warm-up generation after each engine load (enough to reach every code path)."""


class BenchRun:
    """State of one `specdecode bench` run; `run()` returns the summary dict."""

    def __init__(self, cfg: BenchConfig, command: str = "") -> None:
        self.cfg = cfg
        self.command = command or " ".join(sys.argv)
        self.specs = [parse_method(m, cfg.draft, cfg.heads) for m in cfg.methods]
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate methods in {names}")
        if not self.specs:
            raise ValueError("no methods given")
        parse_peers(cfg.peers)  # unknown names fail now, not after the methods ran
        if cfg.round_size is not None and cfg.round_size < 1:
            raise ValueError(f"round size must be >= 1, got {cfg.round_size}")
        self.state: RunState | None = None
        self.prompts: list[BenchPrompt] = []

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.state.records if self.state is not None else []

    def _todo(self, method: str, prompts: list[BenchPrompt], done: set[tuple[str, str, int]]) -> list[BenchPrompt]:
        return [p for p in prompts if (method, p.task, p.index) not in done]

    def _ids(self, prompts: list[BenchPrompt]) -> list[list[int]]:
        assert self.state is not None and self.state.prompt_ids is not None
        index = {(p.task, p.index): i for i, p in enumerate(self.prompts)}
        return [self.state.prompt_ids[index[(p.task, p.index)]] for p in prompts]

    # ---- ours ----

    def _params(self, max_tokens: int | None = None) -> Any:
        from specdecode import SamplingParams

        return SamplingParams(max_tokens=max_tokens or self.cfg.max_tokens, temperature=self.cfg.temperature,
                              seed=self.cfg.seed)

    def _run_ours(self, spec: MethodSpec, prompts: list[BenchPrompt], bar: Any) -> None:
        from specdecode import LLM

        cfg, state = self.cfg, self.state
        assert state is not None
        bar.set_postfix_str(f"{spec.name}: loading")
        rss_before = current_rss()
        with RssSampler() as sampler:
            llm, load_seconds = _timed(lambda: LLM(cfg.model, dtype=cfg.dtype, device=cfg.device,
                                                   speculative_config=spec.speculative_config,
                                                   max_model_len=cfg.max_model_len, seed=cfg.seed,
                                                   quantization=spec.quantization,
                                                   # each prompt once, prefilled in full, as the peers do
                                                   enable_prefix_caching=False))
            rss_loaded = current_rss()
            if state.prompt_ids is None:  # the target's chat template, once, shared by every method
                state.prompt_ids = [llm.chat_prompt_ids(p.messages) for p in self.prompts]
                state.eos_token_id = llm.tokenizer.eos_token_id
                state.save()
            if cfg.flat_verify_cost and llm.cost is not None:
                llm.cost = llm.engine.cost = llm.measure_cost(llm.engine.proposer, llm.max_num_seqs, flat=True)
                state.add_note(f"{spec.name}: k and tree sized for a flat verification cost (--flat-verify-cost: "
                               "as on a GPU); τ is that hardware's, tokens/s this machine's")
            memory = _engine_memory(llm)
            if spec.speculative_config is None:  # a plain run: its format's memory floor is reported
                state.plain_weights[spec.name] = {"method": spec.name, **weight_bytes_per_token(llm.target.model)}
            params = self._params()
            ids_list = self._ids(prompts)
            if cfg.warmup:
                bar.set_postfix_str(f"{spec.name}: warm-up")
                _generate_ours(llm, ids_list[0], self._params(min(WARMUP_TOKENS, cfg.max_tokens)))
            bar.set_postfix_str(spec.name)
            for prompt, ids in zip(prompts, ids_list, strict=True):
                (out, accepted, drafted), seconds = _timed(lambda ids=ids: _generate_ours(llm, ids, params))
                state.add_record(_ours_record(spec.name, prompt, ids, out, seconds, accepted, drafted))
                bar.update(1)
            rss_after = current_rss()
        state.merge_resources(spec.name, {
            "engine": "specdecode", "speculative_config": spec.speculative_config, "load_seconds": load_seconds,
            "rss_before_load_bytes": rss_before, "rss_after_load_bytes": rss_loaded,
            "rss_after_run_bytes": rss_after, "peak_rss_bytes": sampler.peak, **memory,
        })
        state.save()
        llm = None  # free the engine before the next method's is built
        gc.collect()

    # ---- peers ----

    def _peer_context(self) -> PeerContext:
        """Paths now; the prompt-dependent fields are filled in once the prompt ids are known."""
        from specdecode.fetch import resolve_model
        from specdecode.model.load import parse_dtype

        cfg = self.cfg
        return PeerContext(
            target_path=resolve_model(cfg.model), draft_path=resolve_model(cfg.draft) if cfg.draft else None,
            eos_token_id=None, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
            dtype=parse_dtype(cfg.dtype), threads=torch.get_num_threads(), seed=cfg.seed,
        )

    def _peer_names(self, peer: Any) -> list[str]:
        keep = self.cfg.peer_methods
        return [n for n in peer.method_names() if keep is None or n in keep]

    def _warm_peer(self, peer: Any, method: Any, ids: list[int]) -> None:
        full = peer.ctx.max_tokens
        peer.ctx.max_tokens = min(WARMUP_TOKENS, full)
        try:
            method.generate(ids)
        finally:
            peer.ctx.max_tokens = full

    def _run_peer(self, peer: Any, todo: dict[str, list[BenchPrompt]], bar: Any) -> None:
        """Run each of the peer's methods on its prompts still to do (one load of the peer)."""
        state = self.state
        assert state is not None
        bar.set_postfix_str(f"{peer.name}: loading")
        rss_before = current_rss()
        left = sum(len(v) for v in todo.values())
        try:
            with RssSampler() as sampler:
                methods, load_seconds = _timed(peer.open)
                methods = [m for m in methods if todo.get(m.name)]
                rss_loaded = current_rss()
                for method in methods:
                    prompts = todo[method.name]
                    try:
                        if method.prepare is not None:
                            method.prepare()
                        ids_list = self._ids(prompts)
                        if self.cfg.warmup:
                            bar.set_postfix_str(f"{method.name}: warm-up")
                            self._warm_peer(peer, method, ids_list[0])
                        bar.set_postfix_str(method.name)
                        for prompt, ids in zip(prompts, ids_list, strict=True):
                            out_ids, seconds = _timed(lambda ids=ids, g=method.generate: g(ids))
                            state.add_record(_base_record(method.name, peer.name, prompt, ids, out_ids, seconds))
                            bar.update(1)
                            left -= 1
                    except Exception as exc:  # noqa: BLE001 - a peer's failure is a note, not our failure
                        state.add_note(f"{method.name}: failed ({type(exc).__name__}: {exc}); results partial")
                    state.merge_resources(method.name, {
                        "engine": peer.name, "settings": method.settings, "load_seconds": load_seconds,
                        "rss_before_load_bytes": rss_before, "rss_after_load_bytes": rss_loaded,
                        "rss_after_run_bytes": current_rss(), "peak_rss_bytes": None,
                    })
            for method in methods:
                state.merge_resources(method.name, {**state.resources[method.name], "peak_rss_bytes": sampler.peak})
                if method.settings:
                    state.add_note(f"{method.name}: {method.settings}")
        except Exception as exc:  # noqa: BLE001 - e.g. the model cannot be loaded by that engine
            state.add_note(f"{peer.name}: skipped ({type(exc).__name__}: {exc})")
        finally:
            peer.close()
            gc.collect()
            state.save()
            # Keep the bar's total honest when a peer stopped early.
            bar.total = max(bar.n, bar.total - left)
            bar.refresh()

    # ---- the run ----

    def _rounds(self) -> list[list[BenchPrompt]]:
        """Rounds take prompts from every task in turn, so a run stopped early still covers all tasks."""
        if not self.cfg.round_size:
            return [self.prompts]
        rank = {t: i for i, t in enumerate(dict.fromkeys(p.task for p in self.prompts))}
        order = sorted(self.prompts, key=lambda p: (p.index, rank[p.task]))
        size = self.cfg.round_size
        return [order[i : i + size] for i in range(0, len(order), size)]

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.prompts = load_prompts(cfg.dataset, cfg.tasks, cfg.per_task, cfg.limit)
        state = self.state = RunState.start(cfg.out, asdict(cfg), cfg.resume, read_only=cfg.report_only)
        if cfg.report_only:
            return self._write_outputs()
        machine = machine_info()
        if cfg.redo:
            state.add_note(f"{machine['date']}: measured again: {', '.join(cfg.redo)} "
                           f"({state.forget(cfg.redo)} records dropped)")
        state.sessions.append({**machine, "command": self.command, "records_before": len(state.records)})
        if cfg.bandwidth_gb > 0:
            # A run stored before sessions kept their probes has its one probe in state.bandwidth.
            if state.bandwidth is not None and not any({"bandwidth", "bandwidth_probes"} & s.keys()
                                                       for s in state.sessions):
                state.sessions[0]["bandwidth"] = {k: v for k, v in state.bandwidth.items()
                                                  if k != "probes_read_gb_per_s"}
            self._probe_bandwidth()
        state.save()
        # plain first: it is the baseline, and its target gives the prompt ids and weight bytes
        specs = sorted(self.specs, key=lambda s: s.name != "plain")
        if specs[0].name != "plain":
            state.add_note("no `plain` method in this run: speedups and identical-output rates are not computed")
        peers: list[Any] = []
        ctx = None
        if cfg.peers:
            ctx = self._peer_context()
            peers, notes = make_peers(cfg.peers, ctx)
            for note in notes:
                state.add_note(note)
        done = state.done()
        names = [s.name for s in specs] + [n for p in peers for n in self._peer_names(p)]
        bar = _progress(sum(len(self._todo(n, self.prompts, done)) for n in names), cfg.progress)
        try:
            for i, prompts in enumerate(self._rounds()):
                if i and cfg.bandwidth_gb > 0:
                    self._probe_bandwidth()
                for spec in specs:
                    todo = self._todo(spec.name, prompts, done)
                    if todo:
                        self._run_ours(spec, todo, bar)
                if ctx is None or state.prompt_ids is None:
                    continue
                ctx.eos_token_id = state.eos_token_id
                ctx.max_prompt_tokens = max(len(i) for i in state.prompt_ids)
                for peer in peers:
                    todo_by_method = {n: self._todo(n, prompts, done) for n in self._peer_names(peer)}
                    if any(todo_by_method.values()):
                        self._run_peer(peer, todo_by_method, bar)
        finally:
            bar.close()
        if cfg.peak_rss_alone and state.prompt_ids:
            self._measure_alone(specs, peers)
        return self._write_outputs()

    def _measure_alone(self, specs: list[MethodSpec], peers: list[Any]) -> None:
        """Peak RSS of each plain engine alone (ours in each format, llama.cpp's), once per method: the first
        prompt, the run's max tokens, the same context size and threads."""
        from specdecode.bench.child_rss import peak_rss_alone
        from specdecode.engine.llm import DEFAULT_MAX_MODEL_LEN
        from specdecode.fetch import resolve_model
        from specdecode.model.load import read_config

        cfg, state = self.cfg, self.state
        assert state is not None and state.prompt_ids is not None
        path = resolve_model(cfg.model)
        n_ctx = min(cfg.max_model_len or DEFAULT_MAX_MODEL_LEN, read_config(path).max_position_embeddings)
        jobs = [(s.name, "specdecode", s.quantization) for s in specs if s.speculative_config is None]
        jobs += [("llamacpp-plain", "llama.cpp", "none") for p in peers if "llamacpp-plain" in self._peer_names(p)]
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

    def _probe_bandwidth(self) -> None:
        """Probe the read bandwidth now (at the start of each session and between rounds); the floor uses
        the median of every probe so far. On this shared machine one probe reads anywhere from 27 to
        61 GB/s: the floor should not hang on one moment."""
        state = self.state
        assert state is not None
        probe = measure_bandwidth(self.cfg.bandwidth_gb)
        session = state.sessions[-1]
        session.setdefault("bandwidth_probes", []).append(probe)  # sessions stored before: one "bandwidth"
        probes = [b for s in state.sessions for b in (s.get("bandwidth_probes") or [s.get("bandwidth")]) if b]
        state.bandwidth = median_probe(probes)
        state.save()

    def _write_outputs(self) -> dict[str, Any]:
        from specdecode.bench.report import write_outputs

        assert self.state is not None
        summary = self._summary(self.prompts, self.state.bandwidth)
        write_outputs(self.cfg.out, None if self.cfg.report_only else self.records, summary, plots=self.cfg.plots)
        return summary

    def _summary(self, prompts: list[BenchPrompt], bandwidth: dict[str, Any] | None) -> dict[str, Any]:
        cfg, state = self.cfg, self.state
        assert state is not None
        records, complete = stats.complete_prompts(self.records)
        notes = list(state.notes)
        if complete < len(prompts):
            notes.append(f"partial run: {complete} of {len(prompts)} prompts were measured by every method, and "
                         "only those are summarized; rerun the command with --resume to continue")
        own = {}
        methods_seen = {r["method"] for r in records}
        for m in methods_seen:
            for prefix in ("hf-", "llamacpp-"):
                if m.startswith(prefix) and m != prefix + "plain" and prefix + "plain" in methods_seen:
                    own[m] = prefix + "plain"
        summary = stats.summarize(records, "plain", own)
        for method, res in state.resources.items():
            if method in summary["by_method"]:
                summary["by_method"][method]["resources"] = res
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
        floor = floors.get("plain")
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
            "memory_floor": floor,
            "memory_floors": floors,
            "process_peak_rss_bytes": process_peak_rss(),
            "notes": notes,
            **summary,
        }


def run_bench(cfg: BenchConfig, command: str = "") -> dict[str, Any]:
    """Run the benchmark and write records.jsonl, summary.json, summary.md and plots into cfg.out."""
    return BenchRun(cfg, command).run()
