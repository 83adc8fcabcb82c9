"""OpenAI requests -> the engine's: checked, tokenized (on the tokenizer thread), turned into `n` Sequences
with their SamplingParams and queued on the engine as one ChoiceGroup. Everything the engine would refuse is a
400 naming the field, a full queue a 429 and a dead engine a 503."""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from specdecode.engine.core import QueueFullError
from specdecode.engine.sequence import Sequence
from specdecode.sampling import SamplingParams
from specdecode.server.async_engine import EngineDeadError
from specdecode.server.choices import ChoiceGroup
from specdecode.server.errors import APIError
from specdecode.server.protocol import SEED_MAX, ChatCompletionRequest, CompletionRequest
from specdecode.server.state import ServerState
from specdecode.server.structured import structured_params
from specdecode.server.tools import ToolPlan, chat_messages, tool_grammar

RETRY_AFTER_S = 1
_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "min_tokens",
                    "logit_bias", "logprobs"}


def _check_text(text: str, param: str) -> None:
    """Refuse strings that are not valid Unicode (JSON "\\ud800" escapes decode to lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} is not valid Unicode (a lone surrogate escape)", param) from None


def _check_common(state: ServerState, body: ChatCompletionRequest | CompletionRequest) -> None:
    state.check_model(body.model)
    if body.cache_salt is not None:
        _check_text(body.cache_salt, "cache_salt")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")


async def prepare_completion(state: ServerState, body: CompletionRequest) -> ChoiceGroup:
    """A completion request's choices, queued on the engine."""
    _check_common(state, body)
    if body.echo:
        raise APIError(400, "echo is not supported", "echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.best_of not in (None, body.n or 1):
        raise APIError(400, "best_of other than n is not supported (no choices are generated to be dropped)",
                       "best_of")
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a list holding one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        _check_text(prompt, "prompt")
        text = prompt
        try:
            ids = await state.run_tokenizer(lambda: state.llm.tokenizer.encode(text))
        except Exception as exc:
            raise APIError(400, f"cannot tokenize the prompt: {exc}", "prompt") from None
    else:
        ids = list(prompt)
    if not ids:
        raise APIError(400, "prompt is empty", "prompt")
    seqs = _sequences(state, body, ids, "prompt", body.max_tokens, body.logprobs)
    return await _submit(state, body, seqs)


async def prepare_chat(state: ServerState, body: ChatCompletionRequest, plan: ToolPlan | None) -> ChoiceGroup:
    """A chat completion request's choices, queued on the engine."""
    _check_common(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    ids = await _chat_prompt_ids(state, body, plan)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await _submit(state, body, _sequences(state, body, ids, "messages", max_tokens, logprobs, plan))


async def _chat_prompt_ids(state: ServerState, body: ChatCompletionRequest, plan: ToolPlan | None) -> list[int]:
    """The chat template applied to the conversation (and the tools, where the template renders them), on
    the tokenize thread; a conversation the template rejects is a 400."""
    messages = chat_messages(body.messages, plan)
    tools = plan.tools if plan is not None and plan.in_template else None

    def encode() -> list[int]:
        return state.llm.chat_prompt_ids(messages, tools)

    try:
        return await state.run_tokenizer(encode)
    except Exception as exc:  # the model's template may reject a conversation (roles, order)
        raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None


def _sequences(state: ServerState, body: ChatCompletionRequest | CompletionRequest, ids: list[int],
               prompt_field: str, max_tokens: int | None, logprobs: int | None,
               plan: ToolPlan | None = None) -> list[Sequence]:
    """The request's `n` sequences: one prompt, one prefill group, choice i seeded with seed + i (each
    choice compiles its own grammar matcher under structured outputs or a tool grammar)."""
    if any(t >= state.vocab_size for t in ids):
        raise APIError(400, f"token ids must be < the vocabulary size {state.vocab_size}", prompt_field)
    room = state.llm.max_model_len - len(ids)
    if room < 1:
        raise APIError(400, f"the prompt ({len(ids)} tokens) fills the context length {state.llm.max_model_len}: "
                            "no room for output", prompt_field, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(state.default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                            f"{state.llm.max_model_len}", "max_tokens", "context_length_exceeded")
    given = {
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty, "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty, "seed": body.seed,
    }
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    stop = body.stop
    kwargs["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    for s in kwargs["stop"]:
        _check_text(s, "stop")
    kwargs["stop_token_ids"] = tuple(body.stop_token_ids or ())
    kwargs["ignore_eos"] = bool(body.ignore_eos)
    kwargs["structured_outputs"] = structured_params(body, tool_grammar(plan) if plan is not None else None)
    kwargs["logprobs"] = logprobs
    kwargs["min_tokens"] = body.min_tokens or 0
    kwargs["logit_bias"] = _logit_bias(state, body.logit_bias)
    n = body.n or 1
    if n > 1:  # distinct choices, reproducible with a seed
        base = body.seed if body.seed is not None else secrets.randbits(62)
        seeds = [base + i if base + i <= SEED_MAX else base - i for i in range(n)]
    try:
        params = SamplingParams(max_tokens=max_tokens, **kwargs)
        if n == 1:
            seqs = [state.llm.new_sequence(ids, params)]
        else:
            group = object()
            seqs = [state.llm.new_sequence(ids, dataclasses.replace(params, seed=seed)) for seed in seeds]
            for seq in seqs:
                seq.prefill_group = group
        for seq in seqs:
            seq.cache_salt = body.cache_salt
        return seqs
    except ValueError as exc:
        word = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), word if word in _SAMPLING_FIELDS else prompt_field) from None


def _logit_bias(state: ServerState, bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= state.vocab_size:
            raise APIError(400, f"logit_bias keys must be token ids below the vocabulary size {state.vocab_size}, "
                                f"got {key!r}", "logit_bias")
        out[int(key)] = float(value)
    return out


async def _submit(state: ServerState, body: ChatCompletionRequest | CompletionRequest,
                  seqs: list[Sequence]) -> ChoiceGroup:
    spec = body.speculative
    k = spec.num_speculative_tokens if spec is not None else None
    k_override = k if isinstance(k, int) else None
    queue = state.engine.engine.max_waiting
    if queue is not None and len(seqs) > queue:  # could never be queued: a 429 would be retried forever
        raise APIError(400, f"n ({len(seqs)}) exceeds the requests this server queues at once ({queue})", "n")
    try:
        return ChoiceGroup(await state.engine.add_group(seqs, k_override))
    except QueueFullError as exc:
        raise APIError(429, f"the server is busy ({exc}); retry later", None, "rate_limit_exceeded",
                       {"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), None, "engine_unavailable",
                       {"Retry-After": str(RETRY_AFTER_S)}) from None
    except ValueError as exc:
        raise APIError(400, str(exc), "max_tokens", "context_length_exceeded") from None
