"""The Python API, in vLLM's shape: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from specdecode.config import SpeculativeConfig
from specdecode.engine.batch import BatchEngine
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.sequence import RequestOutput, Sequence
from specdecode.engine.validation import (
    check_draft_rows,
    check_memory,
    check_vocab_compatible,
    estimate_bytes,
)
from specdecode.fetch import resolve_model
from specdecode.heads.modules import DraftHead, EagleHead, MedusaHeads
from specdecode.heads.persist import load_head
from specdecode.heads.shipped import shipped_head
from specdecode.log import timed_step
from specdecode.model.fast_linear import convert_linears, draft_linear_format, target_linear_format
from specdecode.model.gguf_model import dense_output_rows
from specdecode.model.load import (
    LoadedModel,
    default_device,
    load_resolved,
    load_tokenizer,
    parse_dtype,
    read_config,
)
from specdecode.proposers.base import Proposer
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.heads import EagleProposer, MedusaProposer
from specdecode.proposers.ngram import NgramProposer
from specdecode.sampling import SamplingParams
from specdecode.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192

Prompt = str | list[int] | dict[str, Any]
"""Text, token ids, or vLLM's dict forms {"prompt": text} / {"prompt_token_ids": ids}."""
Messages = list[dict[str, str]]


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
        quantization: target weight format: "none" (exact, default), "int8" (weight-only), "int8-dynamic"
            (int8 weights x per-token int8 activations, CPU/FBGEMM), "int4" (opt-in: changes the model;
            speculative decoding stays lossless relative to the quantized target), or "gguf" (a .gguf target's
            own quantized blocks, not dequantized: llama.cpp's model in about the file's memory; CPU).
    """

    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype = "bf16",
        device: str | torch.device | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        quantization: str = "none",
    ) -> None:
        self.spec = SpeculativeConfig.from_any(speculative_config)
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = parse_dtype(dtype)
        self.seed = seed
        self._ids = itertools.count()

        target_path = resolve_model(model)
        target_cfg = read_config(target_path)
        self.max_model_len = min(max_model_len or DEFAULT_MAX_MODEL_LEN, target_cfg.max_position_embeddings)
        draft_path = draft_cfg = None
        spec = self.spec
        draft_dtype = self.dtype if spec is None or spec.draft_dtype == "auto" else parse_dtype(spec.draft_dtype)
        parts = [("target", estimate_bytes(target_cfg, self.dtype, self.max_model_len, device=self.device,
                                           gguf_file=target_path if quantization == "gguf" else None))]
        if spec is not None and spec.method == "draft":
            draft_path = resolve_model(str(spec.model))
            draft_cfg = read_config(draft_path)
            parts.append(("draft", estimate_bytes(draft_cfg, draft_dtype, self.max_model_len, device=self.device,
                                                  gguf_file=draft_path if spec.quantization == "gguf" else None)))
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
            convert_linears(self.head, draft_linear_format(spec.quantization, self.dtype, self.device))
        convert_linears(self.target.model, target_linear_format(quantization, self.dtype, self.device))
        self.draft: LoadedModel | None = None
        self.proposer_factory: Callable[[], Proposer] | None = None
        lookup = (spec.prompt_lookup_min, spec.prompt_lookup_max) if spec and spec.draft_prompt_lookup else None
        if spec is not None and spec.method == "draft":
            assert draft_path is not None
            # Refuse an incompatible draft before paying for its weights.
            check_vocab_compatible(model, self.tokenizer, str(spec.model), load_tokenizer(draft_path))
            assert draft_cfg is not None
            # Same tokenizer, differently padded embeddings: the draft drafts over the real ids only.
            rows = check_draft_rows(model, target_cfg.vocab_size, str(spec.model), draft_cfg.vocab_size,
                                    self.tokenizer)
            self.draft = load_resolved(draft_path, str(spec.model), draft_dtype, self.device,
                                       "gguf" if spec.quantization == "gguf" else "none")
            convert_linears(self.draft.model, draft_linear_format(spec.quantization, draft_dtype, self.device))
            draft_model = self.draft.model
            width, branching = spec.tree_width, spec.tree_branching
            self.proposer_factory = lambda: DraftModelProposer(draft_model, self.max_model_len, width, branching,
                                                               lookup, vocab=rows)
        elif isinstance(self.head, EagleHead):
            head, width, branching = self.head, spec.tree_width, spec.tree_branching
            columns = spec.head_prompt_tokens
            self.proposer_factory = lambda: EagleProposer(head, self.max_model_len, width, branching, columns)
        elif isinstance(self.head, MedusaHeads):
            medusa, width, branching = self.head, spec.tree_width, spec.tree_branching
            columns = spec.head_prompt_tokens
            self.proposer_factory = lambda: MedusaProposer(medusa, width, branching, columns)
        elif spec is not None:
            lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
            self.proposer_factory = lambda: NgramProposer(lo, hi)
        proposer = self.proposer_factory() if self.proposer_factory is not None else None
        k_max = spec.k_max if spec is not None else 0
        fixed = None if (spec is None or spec.adaptive) else int(spec.num_speculative_tokens)
        self.decoder = SpeculativeDecoder(self.target.model, self.max_model_len, proposer, k_max, fixed,
                                          tree_lookup=lookup)
        if proposer is not None and fixed is None:
            with timed_step(logger, "measured the target's forward costs (they choose the draft length)") as step:
                cost = self.decoder.measure_cost()
                step["detail"] = f"1-token forward {1000 * cost.target_forward_seconds(1):.1f} ms"

    def batch_engine(self, max_num_seqs: int = 8, max_waiting: int = 64) -> BatchEngine:
        """A continuous-batching engine over the same weights (for serving); measures its cost at start-up."""
        k_max = self.spec.k_max if self.spec is not None else 0
        fixed = None if (self.spec is None or self.spec.adaptive) else int(self.spec.num_speculative_tokens)
        # Every row's KV cache is allocated up front: refuse now rather than run out of memory under load.
        width = self.dtype.itemsize
        slots = self.max_model_len + MAX_TREE_NODES
        parts = [("target KV cache", self.target.config.kv_bytes_per_token(width) * slots * max_num_seqs)]
        if self.draft is not None:
            draft_width = self.draft.model.dtype.itemsize
            parts.append(("draft KV caches", self.draft.config.kv_bytes_per_token(draft_width) * slots * max_num_seqs))
        check_memory(parts, self.device)
        engine = BatchEngine(self.target.model, self.max_model_len, max_num_seqs, max_waiting,
                             self.proposer_factory, k_max, fixed)
        with timed_step(logger, f"measured the batch engine's forward costs ({max_num_seqs} rows)"):
            engine.measure_cost()
        return engine

    def new_sequence(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        """Validate and tokenize one request (raises ValueError on bad input)."""
        if isinstance(prompt, dict):
            prompt = _unwrap_prompt(prompt)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length "
                f"{self.max_model_len}"
            )
        return Sequence(
            str(next(self._ids)), ids, params, self.tokenizer, self.target.config.vocab_size, self.device,
            self.seed, prompt=prompt if isinstance(prompt, str) else None,
        )

    def generate(
        self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        seqs = [self.new_sequence(p, params) for p in prompts]  # validate all before any compute
        return [self.decoder.generate(s).to_output() for s in seqs]

    def chat_prompt_ids(self, messages: Messages) -> list[int]:
        if not messages:
            raise ValueError("messages is empty")
        return self.tokenizer.apply_chat_template(messages)

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
        for s in self.decoder.iterate(seq):
            delta = s.take_stream_text()
            if delta or s.finished:
                yield delta, s


def _unwrap_prompt(prompt: dict[str, Any]) -> str | list[int]:
    """vLLM's TextPrompt / TokensPrompt dicts: exactly one of "prompt" and "prompt_token_ids"."""
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return prompt["prompt_token_ids"]
    raise ValueError(f'a dict prompt needs exactly one key, "prompt" (text) or "prompt_token_ids" (a list of ids), '
                     f"got keys {sorted(keys)}")
