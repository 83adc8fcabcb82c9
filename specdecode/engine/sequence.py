"""One request's state: tokens, penalty counters, random generator, text, stop status."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdecode.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from specdecode.engine.logprobs import TokenLogprob
from specdecode.metrics import SpecStats
from specdecode.model.tokenizer import Tokenizer
from specdecode.proposers.base import SequenceView
from specdecode.sampling import SamplingParams
from specdecode.structured.matcher import TokenMatcher, build_matcher


@dataclass
class CompletionOutput:
    """vLLM-style per-completion view (`request_output.outputs[0]`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    """One per token of token_ids when `SamplingParams.logprobs` is set."""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """"stop" (EOS, stop token or stop string), "length" (max_tokens or context) or "error" (the engine failed
    this request alone: `error` says why)."""
    metrics: dict = field(default_factory=dict)
    """prompt_tokens, output_tokens, seconds, tokens_per_second, prefill_seconds, cached_tokens (prompt tokens
    read from the prefix cache) + speculative stats."""
    logprobs: list[TokenLogprob] | None = None
    """One per output token when `SamplingParams.logprobs` is set."""
    error: str | None = None
    """Why the engine failed the request (finish_reason "error"); None otherwise."""

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)]


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        vocab_size: int,
        device: torch.device,
        default_seed: int,
        prompt: str | None = None,
        matcher: TokenMatcher | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        seed = params.seed if params.seed is not None else default_seed
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        if params.has_penalties:
            self.output_counts = torch.zeros(vocab_size, dtype=torch.long, device=device)
            self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.prompt_mask[torch.tensor(prompt_ids, device=device)] = True
        self.eos_token_id = tokenizer.eos_token_id
        self.matcher = matcher
        """The grammar's cursor over the committed output (structured outputs); None when unconstrained."""
        if matcher is None and params.structured_outputs is not None:
            self.matcher = build_matcher(params.structured_outputs, tokenizer, vocab_size)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopStringMatcher(params.stop)
        self.text = ""
        self.emitted_chars = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        """Why the engine failed this request alone (finish_reason "error", engine/row_faults.py)."""
        self.stats = SpecStats()
        self.start_time = time.perf_counter()
        self.prefill_seconds = 0.0
        self.cached_tokens = 0
        """Prompt tokens whose K/V came from the prefix cache (not prefilled)."""
        self.end_time: float | None = None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prefill_group: object | None = None
        """Requests with the same group and prompt (the choices of one `n` > 1 request) share one prefill."""
        self.cache_salt: str | None = None
        """The prefix-cache namespace: only requests with the same salt (or none) share pooled blocks."""

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def view(self) -> SequenceView:
        return SequenceView(
            self.token_ids, self.prompt_len, self.params, self.generator, self.output_counts, self.prompt_mask,
            self.matcher, self.cache_salt,
        )

    def append(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """Add one generated token (and its logprob, when the request asks for them) and apply the stop rules;
        nothing is added after a stop."""
        if self.finished:
            raise RuntimeError("sequence already finished")
        self.token_ids.append(token)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        if self.output_counts is not None:
            self.output_counts[token] += 1
        params = self.params
        if (token == self.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            self._finish("stop")
            return
        if self.matcher is not None:
            self.matcher.consume(token)
        delta = self.detok.add(token)
        if delta:
            self.text += delta
            cut = self.stops.find(self.text, len(delta))
            if cut >= 0:
                self.text = self.text[:cut]
                self._finish("stop")
                return
        if self.matcher is not None and self.matcher.is_stopped():  # complete: only EOS could follow
            self._finish("stop")
            return
        if self.num_output >= params.max_tokens:
            self._finish("length")

    def finish_length(self) -> None:
        """The context is full: no room for another token."""
        self._finish("length")

    def fail(self, message: str) -> None:
        """The engine failed this request alone (its proposal, grammar or sampling raised): it finishes with
        finish_reason "error" and keeps the first message."""
        self.error = self.error or message
        self._finish("error")

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.end_time = time.perf_counter()

    def take_stream_text(self) -> str:
        """Text not yet streamed that can no longer turn into a stop string."""
        limit = len(self.text) if self.finished else self.stops.safe_len(self.text)
        out = self.text[self.emitted_chars : limit]
        self.emitted_chars = max(self.emitted_chars, limit)
        return out

    def to_output(self) -> RequestOutput:
        end = self.end_time or time.perf_counter()
        seconds = end - self.start_time
        n = self.num_output
        metrics = {
            "prompt_tokens": self.prompt_len,
            "output_tokens": n,
            "seconds": seconds,
            "tokens_per_second": n / seconds if seconds > 0 else 0.0,
            "prefill_seconds": self.prefill_seconds,
            "cached_tokens": self.cached_tokens,
            **self.stats.to_dict(),
        }
        return RequestOutput(
            self.request_id, self.prompt, self.token_ids[: self.prompt_len], self.text, self.output_ids,
            self.finish_reason, metrics, None if self.logprobs is None else list(self.logprobs), self.error,
        )
