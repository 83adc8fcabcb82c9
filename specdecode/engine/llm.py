"""The Python API, in vLLM's shape: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specdecode.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_POOL_GB, DRAFT_VOCAB_SIZE, SpeculativeConfig
from specdecode.cost_model import CostModel
from specdecode.engine.core import Engine
from specdecode.engine.cost_cache import CostCache, cost_cache_enabled, file_identity
from specdecode.engine.history import RequestHistory
from specdecode.engine.measure import CostMeasurement
from specdecode.engine.prefix_cache import PrefixCache
from specdecode.engine.proposer_factory import ProposerFactory, lookup_source, proposer_factory
from specdecode.engine.sequence import RequestOutput, Sequence
from specdecode.engine.validation import (
    check_draft_rows,
    check_memory,
    cross_vocab_bridge,
    estimate_bytes,
)
from specdecode.fetch import resolve_model
from specdecode.heads.modules import DraftHead, EagleHead
from specdecode.heads.persist import load_head
from specdecode.heads.shipped import shipped_head
from specdecode.log import timed_step
from specdecode.model.fast_linear import convert_linears, draft_linear_format, target_linear_format
from specdecode.model.format_choice import fastest_format, head_formats_below_bf16
from specdecode.model.gguf_model import dense_output_rows
from specdecode.model.load import (
    LoadedModel,
    default_device,
    load_resolved,
    load_tokenizer,
    parse_dtype,
    read_config,
    resolve_draft_quantization,
    resolve_quantization,
)
from specdecode.model.output_rows import lowest_ids, restrict_output
from specdecode.proposers.base import BatchProposer
from specdecode.proposers.cross_vocab_rows import cross_vocab_context
from specdecode.sampling import SamplingParams
from specdecode.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192

Prompt = str | list[int] | dict[str, Any]
"""Text, token ids, or vLLM's dict forms {"prompt": text} / {"prompt_token_ids": ids}."""
Messages = list[dict[str, Any]]


class LLM:
    """Load a target (and optionally a proposer) once; generate for many prompts.

    Args:
        model: alias (fetched if missing), path to a .gguf file, or a Hugging Face directory.
        dtype: "bf16" (default, fast on CPU) or "fp32" (exact tests).
        device: "cpu", "cuda", ...; default cuda when available.
        speculative_config: dict / JSON / SpeculativeConfig, e.g.
            {"method": "draft", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}.
        max_model_len: context to allocate KV cache for (default min(model's, 8192)).
        seed: default seed of requests that give none.
        quantization: target weight format: "auto" (default: "gguf" for a .gguf target in bf16 on a CPU with
            the GGUF kernels, else "none"), "none" (the model's weights as they are, a GGUF's dequantized; the
            exact comparison), "int8" (weight-only), "int8-dynamic" (int8 weights x per-token int8
            activations, CPU/FBGEMM), "int4" (opt-in: changes the model; speculative decoding stays lossless
            relative to the quantized target), or "gguf" (a .gguf target's own quantized blocks, not
            dequantized: llama.cpp's model in about the file's memory; CPU). The choice is `LLM.quantization`.
        max_num_seqs: requests `generate` runs at once as one batch (more wait for a free row).
        enable_prefix_caching: keep the K/V of finished prompts and responses in a pool and reuse it for later
            prompts that start with the same tokens (on by default; output unchanged).
        prefix_cache_gb: the pool's bound in GiB (least recently used blocks go first).
        max_num_batched_tokens: at most this many prompt tokens prefilled per step while other requests decode
            (a longer prompt is prefilled in chunks between their steps, each sized to cost about 1.5 of their
            steps); None or 0: whole prompts at once.
        batch_invariant: fp32 only; on the paths our kernels do not cover (no AVX512 kernels, attention our
            kernel does not take) compute every token of the target's forwards as if alone, at one pass over the
            weights per token (`Transformer.make_batch_invariant`). Where our kernels run, a token's bits are
            already the same in any batch, cached or not, and this changes nothing.
    """

    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype = "bf16",
        device: str | torch.device | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        quantization: str = "auto",
        max_num_seqs: int = 8,
        enable_prefix_caching: bool = True,
        prefix_cache_gb: float = DEFAULT_POOL_GB,
        max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        batch_invariant: bool = False,
    ) -> None:
        if prefix_cache_gb < 0:
            raise ValueError(f"prefix_cache_gb must be >= 0, got {prefix_cache_gb}")
        if max_num_batched_tokens is not None and max_num_batched_tokens < 0:
            raise ValueError(f"max_num_batched_tokens must be >= 0, got {max_num_batched_tokens}")
        self.max_num_batched_tokens = max_num_batched_tokens or None
        self.spec = SpeculativeConfig.from_any(speculative_config)
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = parse_dtype(dtype)
        self.seed = seed
        self._ids = itertools.count()

        target_path = resolve_model(model)
        quantization = self.quantization = resolve_quantization(quantization, target_path, self.dtype, self.device)
        if batch_invariant and (self.dtype != torch.float32 or quantization != "none"):
            raise ValueError("batch_invariant needs dtype='fp32' and quantization='none' (it computes the target's "
                             f"fp32 linears row by row), got dtype={dtype!r}, quantization={quantization!r}")
        target_cfg = read_config(target_path)
        self.max_model_len = min(max_model_len or DEFAULT_MAX_MODEL_LEN, target_cfg.max_position_embeddings)
        draft_path = draft_cfg = bridge = None
        drafter: tuple[str, Path, str] | None = None  # (name, file or directory, weight format)
        self.draft_quantization: str | None = None
        """The draft model's weight format as resolved at load (None without a draft model)."""
        spec = self.spec
        draft_dtype = self.dtype if spec is None or spec.draft_dtype == "auto" else parse_dtype(spec.draft_dtype)
        parts = [("target", estimate_bytes(target_cfg, self.dtype, self.max_model_len, device=self.device,
                                           gguf_file=target_path if quantization == "gguf" else None))]
        if spec is not None and spec.method == "draft":
            draft_path = resolve_model(str(spec.model))
            draft_cfg = read_config(draft_path)
            self.draft_quantization = resolve_draft_quantization(spec.quantization, draft_path, draft_dtype,
                                                                 self.device)
            parts.append(("draft", estimate_bytes(draft_cfg, draft_dtype, self.max_model_len, device=self.device,
                                                  gguf_file=draft_path if self.draft_quantization == "gguf" else None)))
        check_memory(parts, self.device)  # before any weight is loaded

        self.target: LoadedModel = load_resolved(target_path, model, self.dtype, self.device, quantization)
        self.tokenizer = self.target.tokenizer
        self.head: DraftHead | None = None
        if spec is not None and spec.method in ("eagle", "medusa"):
            # Before the target's linears are converted: the head copies the target's output rows.
            head_dir = spec.model or shipped_head(model, spec.method)
            if head_dir is None:
                raise ValueError(f'method "{spec.method}" needs "model": a head directory trained for {model!r} '
                                 "(`specdecode train-head`); no head ships for this target")
            with dense_output_rows(self.target.model):  # a GGUF target's blocks: dense rows while attaching
                self.head = load_head(str(head_dir), self.target.model, kind=spec.method)
            if isinstance(self.head, EagleHead) and self.head.config.feature_layers:  # EAGLE-3 style head
                self.target.model.capture_layers = tuple(self.head.config.feature_layers)
            head_format = draft_linear_format(spec.quantization, self.dtype, self.device)
            if spec.quantization == "auto" and head_format == "int8":  # below AVX512-BF16: the fastest, timed
                head_format = fastest_format(self.head, head_formats_below_bf16())
            drafter = (str(head_dir), Path(head_dir), head_format)
            convert_linears(self.head, head_format)
        target_format = target_linear_format(quantization, self.dtype, self.device)
        convert_linears(self.target.model, target_format)
        if batch_invariant:
            self.target.model.make_batch_invariant()
        self.draft: LoadedModel | None = None
        draft_vocab = None
        if spec is not None and spec.method == "draft":
            assert draft_path is not None and draft_cfg is not None
            # Refused before paying for its weights: a draft that cannot work with the target's tokenizer. One with
            # another tokenizer reads the target's text in its own ids (proposers/text_bridge.py).
            draft_tokenizer = load_tokenizer(draft_path)
            bridge = cross_vocab_bridge(model, self.tokenizer, str(spec.model), draft_tokenizer, spec.tree_width)
            if bridge is None:  # same tokenizer, differently padded embeddings: drafts over the real ids only
                draft_vocab = check_draft_rows(model, target_cfg.vocab_size, str(spec.model), draft_cfg.vocab_size,
                                               self.tokenizer)
            else:  # its cache holds more positions than the target's context: checked again at that length
                check_memory([("draft", estimate_bytes(draft_cfg, draft_dtype,
                                                       cross_vocab_context(draft_cfg, self.max_model_len),
                                                       device=self.device, gguf_file=draft_path
                                                       if self.draft_quantization == "gguf" else None))], self.device)
            draft_format = self.draft_quantization
            self.draft = load_resolved(draft_path, str(spec.model), draft_dtype, self.device,
                                       "gguf" if draft_format == "gguf" else "none", draft_tokenizer)
            drafter = (str(spec.model), draft_path, draft_linear_format(draft_format, draft_dtype, self.device))
            vocab_rows = DRAFT_VOCAB_SIZE if spec.draft_vocab_size is None else spec.draft_vocab_size
            if 0 < vocab_rows < draft_cfg.vocab_size:
                added = list(draft_tokenizer.hf.added_tokens_decoder)
                restrict_output(self.draft.model, lowest_ids(draft_cfg.vocab_size, vocab_rows, added))
            convert_linears(self.draft.model, drafter[2])
        self.lookup = lookup_source(spec)
        """The suffix source of lookups (and its store of earlier answers), shared by every engine of this `LLM`."""
        self.batch_factory: ProposerFactory | None = proposer_factory(
            spec, self.max_model_len, self.draft.model if self.draft is not None else None, draft_vocab, self.head,
            self.lookup, bridge)
        """max rows -> the engine's batch proposer: every row drafted together (one forward per level); None
        without speculation."""
        self.prefix_cache = (PrefixCache(int(prefix_cache_gb * 2**30))
                             if enable_prefix_caching and prefix_cache_gb > 0 else None)
        """One pool for every engine over these weights (`generate`'s and the server's)."""
        self.max_num_seqs = max_num_seqs
        self.k_max = spec.k_max if spec is not None else 0
        self.fixed_k = None if (spec is None or spec.adaptive) else int(spec.num_speculative_tokens)
        self.cost_cache: CostCache | None = None
        """Costs measured in earlier processes on this machine and set-up (engine/cost_cache.py); None: off."""
        if spec is not None and cost_cache_enabled():
            self.cost_cache = CostCache({
                "target": {**file_identity(model, target_path), "format": target_format, "dtype": str(self.dtype),
                           "batch_invariant": batch_invariant},
                "drafter": None if drafter is None else {**file_identity(drafter[0], drafter[1]), "format": drafter[2],
                                                         "dtype": str(draft_dtype)},
                "speculative": {**dataclasses.asdict(spec), "model": None},  # the drafter's files name it
                "max_len": self.max_model_len}, self.device)
        cache = self.cost_cache
        self.history = RequestHistory(cache.get("history") if cache else None,
                                      on_change=functools.partial(cache.put, "history") if cache else None)
        """What earlier requests of this pair measured: acceptance and output length (engine/history.py)."""
        proposer = self.new_proposer(max_num_seqs)
        self.measurement: CostMeasurement | None = None
        """The start-up measurement behind `cost`, extended when a call first runs more rows than it covers."""
        self.cost: CostModel | None = None
        """The measured cost model (adaptive k only): what `generate`'s batches and the server's are sized by.
        One row at start-up; `generate` measures batch shapes the first time it runs that many rows."""
        if proposer is not None and self.fixed_k is None:
            self.measurement = self._cached_measurement(proposer)
            self.cost = self._measured(1)
            if self.measurement.restored:  # nothing ran yet: the first request would pay the first calls
                self.measurement.warm_up()
        self.engine = self._engine(proposer, self.cost, max_num_seqs, None, allocate=False)
        """The engine of `generate` and `stream` (its cache grows to the rows a call needs)."""

    def new_proposer(self, max_rows: int | None = None) -> BatchProposer | None:
        """A batch proposer for up to max_rows rows (None without speculation)."""
        return self.batch_factory(max_rows or self.max_num_seqs) if self.batch_factory is not None else None

    def measure_cost(self, proposer: BatchProposer | None, max_rows: int, flat: bool = False) -> CostModel:
        """Time the target's forwards (one row up to a whole tree, and batches up to max_rows rows) and the
        drafter's step afresh."""
        return self._measured(max_rows, CostMeasurement(self.target.model, proposer, self.k_max, self.max_model_len,
                                                        flat=flat))

    def _cached_measurement(self, proposer: BatchProposer) -> CostMeasurement:
        """The start-up measurement, holding what an earlier process on this machine and set-up measured."""
        m = CostMeasurement(self.target.model, proposer, self.k_max, self.max_model_len)
        cache = self.cost_cache
        if cache is not None and (record := cache.get("costs")) is not None:
            if m.restore(record):
                logger.debug("forward costs (up to %d rows) from the cost cache %s", m.rows, cache.path)
            else:
                logger.warning("ignoring the incomplete costs in %s: measuring them again", cache.path)
        return m

    def _measured(self, rows: int, measurement: CostMeasurement | None = None) -> CostModel:
        """The cost model for batches of up to `rows` rows, measuring the shapes not yet measured (the start-up
        measurement's are kept in the cost cache, and measured once per machine and set-up)."""
        m = measurement or self.measurement
        assert m is not None
        if m.rows >= rows:
            return m.cost(rows)
        cache = self.cost_cache if measurement is None else None
        what = f"measured the target's forward costs (up to {rows} rows; they size drafts)"
        if cache is not None:
            logger.info("measuring the forward costs of this machine and set-up (up to %d rows; once: they are "
                        "kept in %s)", rows, cache.path)
        with timed_step(logger, what, always=cache is not None) as step:
            cost = m.cost(rows)
            step["detail"] = f"1-token forward {1000 * cost.target_forward_seconds(1):.1f} ms"
        if cache is not None:
            cache.put("costs", m.record())
        return cost

    def _engine(self, proposer: BatchProposer | None, cost: CostModel | None, max_num_seqs: int,
                max_waiting: int | None, allocate: bool) -> Engine:
        return Engine(self.target.model, self.max_model_len, proposer, self.k_max, self.fixed_k, cost, max_num_seqs,
                      max_waiting, self.lookup, allocate=allocate, prefix_cache=self.prefix_cache,
                      max_num_batched_tokens=self.max_num_batched_tokens, history=self.history)

    def batch_engine(self, max_num_seqs: int = 8, max_waiting: int = 64) -> Engine:
        """A continuous-batching engine over the same weights, for serving (the one engine core, with its own
        cache rows allocated now and its own drafting states); measures its cost unless `generate`'s covers
        as many rows."""
        proposer = self.new_proposer(max_num_seqs)  # allocates nothing yet
        # Every row's KV cache is allocated up front: refuse now rather than run out of memory under load.
        parts = self._row_cache_parts(max_num_seqs, proposer)
        if self.prefix_cache is not None:
            parts.append(("prefix cache", self.prefix_cache.max_bytes))
        check_memory(parts, self.device)
        cost = self.cost
        if proposer is not None:
            if self.measurement is None:  # a fixed k: the server still sizes its batches by the cost
                self.measurement = self._cached_measurement(proposer)
            cost = self._measured(max_num_seqs)
        return self._engine(proposer, cost, max_num_seqs, max_waiting, allocate=True)

    def _row_cache_parts(self, rows: int, proposer: BatchProposer | None) -> list[tuple[str, int]]:
        """(label, bytes) of the caches `rows` batch rows allocate: the target's KV cache and the proposer's
        drafting state (a draft's KV cache, a head's cache and features)."""
        slots = self.max_model_len + MAX_TREE_NODES
        per_token = self.target.config.kv_bytes_per_token(self.dtype.itemsize)
        parts = [(f"target KV cache ({rows} rows x {slots} slots)", per_token * slots * rows)]
        if proposer is not None and (drafting := proposer.state_bytes(rows)):
            parts.append((f"{proposer.name} drafting state ({rows} rows)", drafting))
        return parts

    def _grow_rows(self, rows: int) -> None:
        """Make `generate`'s engine ready for `rows` rows: refuse before allocating caches that do not fit (naming
        their sizes), and measure the batch shapes the cost model has not seen yet."""
        engine = self.engine
        have = engine.cache.batch_size if engine.cache is not None else 0
        if rows > have:
            check_memory(self._row_cache_parts(rows, engine.proposer), self.device,
                         f"lower max_num_seqs (now {self.max_num_seqs}: rows run at once) or max_model_len")
        m = self.measurement
        if m is not None and rows > m.rows and engine.cost is self.cost:  # not a cost the caller set
            self.cost = engine.cost = self._measured(rows)
        engine.reserve(rows)

    def new_sequence(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        """Validate and tokenize one request (raises ValueError on bad input)."""
        salt = None
        if isinstance(prompt, dict):
            prompt, salt = _unwrap_prompt(prompt)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length "
                f"{self.max_model_len}"
            )
        vocab = self.target.config.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be < the vocabulary size {vocab}")
        seq = Sequence(
            str(next(self._ids)), ids, params, self.tokenizer, self.target.config.vocab_size, self.device,
            self.seed, prompt=prompt if isinstance(prompt, str) else None,
        )
        seq.cache_salt = salt
        return seq

    def generate(
        self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        seqs = [self.new_sequence(p, params) for p in prompts]  # validate all before any compute
        return [s.to_output() for s in self.run_sequences(seqs)]

    def run_sequences(self, seqs: list[Sequence]) -> list[Sequence]:
        """Run sequences to completion as one batch (up to max_num_seqs rows at a time)."""
        engine = self.engine
        self._grow_rows(min(len(seqs), self.max_num_seqs))
        for s in seqs:
            engine.add(s)
        try:
            while engine.has_work():
                engine.step()
        finally:
            for s in seqs:  # an interrupted call leaves nothing behind for the next one
                if not s.finished:
                    engine.abort(s.request_id)
        return seqs

    def chat_prompt_ids(self, messages: Messages, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation through the model's chat template (`tools`: OpenAI tool objects it renders)."""
        if not messages:
            raise ValueError("messages is empty")
        return self.tokenizer.apply_chat_template(messages, tools)

    def chat(
        self, messages: Messages | list[Messages], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt_ids(m) for m in conversations], sampling_params)  # type: ignore[arg-type]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[tuple[str, Sequence]]:
        """Yield (new text, sequence) after every step; the text never contains part of a stop string."""
        seq = self.new_sequence(prompt, sampling_params or SamplingParams())
        engine = self.engine
        self._grow_rows(1)
        engine.add(seq)
        try:
            while not seq.finished:
                if seq in engine.step():
                    delta = seq.take_stream_text()
                    if delta or seq.finished:
                        yield delta, seq
        finally:
            if not seq.finished:  # the consumer stopped early
                engine.abort(seq.request_id)


def _unwrap_prompt(prompt: dict[str, Any]) -> tuple[str | list[int], str | None]:
    """vLLM's TextPrompt / TokensPrompt dicts: exactly one of "prompt" and "prompt_token_ids", and optionally
    "cache_salt" (the prefix cache's namespace: only prompts with the same salt share cached blocks)."""
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f'"cache_salt" must be a non-empty string, got {salt!r}')
    keys = set(prompt) - {"cache_salt"}
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"], salt
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return prompt["prompt_token_ids"], salt
    raise ValueError(f'a dict prompt needs exactly one key, "prompt" (text) or "prompt_token_ids" (a list of ids), '
                     f'and may have "cache_salt"; got keys {sorted(keys)}')
