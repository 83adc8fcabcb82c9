"""The benchmark run: every method over every prompt, in rounds, resumable; our methods and the peers'.

Protocol (Spec-Bench): greedy by default, batch 1, one warm-up generation per method that is not counted, each
prompt's time includes its prefill, per-prompt tokens/s = output tokens / seconds, generation stops at EOS as a
user's would (``ignore_eos`` off). Every method (ours and peers) gets the same prompt token ids (the target's
chat template) and the same max tokens. One engine object is built per method, reused over all prompts and freed
before the next is built, so each method's memory is its own.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import asdict
from typing import Any

import torch

from specdecode.bench.bandwidth import measure_bandwidth, median_probe, weight_bytes_per_token
from specdecode.bench.datasets import BenchPrompt, load_prompts
from specdecode.bench.machine import machine_info
from specdecode.bench.memory import RssSampler, current_rss, engine_memory, measure_alone
from specdecode.bench.methods import MethodSpec, parse_method
from specdecode.bench.peer_base import PeerContext
from specdecode.bench.peers import make_peers, parse_peers
from specdecode.bench.records import WARMUP_TOKENS, base_record, generate_ours, ours_record, timed
from specdecode.bench.run_config import BenchConfig
from specdecode.bench.run_state import RunState
from specdecode.bench.summary import build_summary


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="prompt", disable=not enabled, dynamic_ncols=True)


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
            llm, load_seconds = timed(lambda: LLM(cfg.model, dtype=cfg.dtype, device=cfg.device,
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
            memory = engine_memory(llm)
            if spec.speculative_config is None:  # a plain run: its format's memory floor is reported
                state.plain_weights[spec.name] = {"method": spec.name, **weight_bytes_per_token(llm.target.model)}
            params = self._params()
            ids_list = self._ids(prompts)
            if cfg.warmup:
                bar.set_postfix_str(f"{spec.name}: warm-up")
                generate_ours(llm, ids_list[0], self._params(min(WARMUP_TOKENS, cfg.max_tokens)))
                if llm.lookup is not None and llm.lookup.store is not None:
                    llm.lookup.store.clear()  # the warm-up's answer would be the first prompt's own
            bar.set_postfix_str(spec.name)
            for prompt, ids in zip(prompts, ids_list, strict=True):
                (out, accepted, drafted), seconds = timed(lambda ids=ids: generate_ours(llm, ids, params))
                state.add_record(ours_record(spec.name, prompt, ids, out, seconds, accepted, drafted))
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
                methods, load_seconds = timed(peer.open)
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
                            out_ids, seconds = timed(lambda ids=ids, g=method.generate: g(ids))
                            state.add_record(base_record(method.name, peer.name, prompt, ids, out_ids, seconds))
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
            # A stored run whose sessions hold no probes keeps its one probe in state.bandwidth: its first session's.
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
            llamacpp_plain = any("llamacpp-plain" in self._peer_names(p) for p in peers)
            measure_alone(state, cfg, specs, llamacpp_plain)
        return self._write_outputs()

    def _probe_bandwidth(self) -> None:
        """Probe the read bandwidth now (at the start of each session and between rounds); the floor uses
        the median of every probe so far: on a shared machine one probe varies widely, and the floor should not
        hang on one moment."""
        state = self.state
        assert state is not None
        probe = measure_bandwidth(self.cfg.bandwidth_gb)
        session = state.sessions[-1]
        session.setdefault("bandwidth_probes", []).append(probe)  # a stored session without probes: one "bandwidth"
        probes = [b for s in state.sessions for b in (s.get("bandwidth_probes") or [s.get("bandwidth")]) if b]
        state.bandwidth = median_probe(probes)
        state.save()

    def _write_outputs(self) -> dict[str, Any]:
        from specdecode.bench.report import write_outputs

        assert self.state is not None
        summary = build_summary(self.cfg, self.state, self.prompts, self.state.bandwidth)
        write_outputs(self.cfg.out, None if self.cfg.report_only else self.records, summary, plots=self.cfg.plots)
        return summary


def run_bench(cfg: BenchConfig, command: str = "") -> dict[str, Any]:
    """Run the benchmark and write records.jsonl, summary.json, summary.md and plots into cfg.out."""
    return BenchRun(cfg, command).run()
