"""OpenAI requests -> the engine's: checked, tokenized (on the tokenizer thread), their grammar compiled (on a
grammar thread), turned into `n` Sequences with their SamplingParams and queued on the engine as one ChoiceGroup.
Everything the engine would refuse is a 400 naming the field, a full queue a 429 and a dead engine a 503.

Work before admission is bounded: a request's size bounds (messages, tools) and the queue are checked before
any tokenizer or grammar work, and requests being prepared count as waiting, so that a burst beyond the queue
is refused at once instead of lining up at the tokenizer.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from specdecode.engine.core import QueueFullError
from specdecode.engine.sequence import Sequence
from specdecode.sampling import SamplingParams
from specdecode.server.async_engine import EngineDeadError
from specdecode.server.choices import ChoiceGroup
from specdecode.server.errors import APIError
from specdecode.server.protocol import SEED_MAX, ChatCompletionRequest, CompletionRequest
from specdecode.server.state import ServerState
from specdecode.server.structured import compile_constraint, constraint_field, structured_params
from specdecode.server.tools import ToolPlan, chat_messages, tool_grammar

RETRY_AFTER_S = 1
MAX_MESSAGES = 2048
"""Messages of one chat request (OpenAI's bound too); more: a 400 before the chat template runs."""
MAX_TOOL_BYTES = 64 << 10
"""One tool's definition as JSON (its name, description and parameter schema); larger: a 400 before the chat
template or the grammar engine sees it."""
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
    with _queue_place(state, body.n or 1):
        if isinstance(prompt, str):
            text = prompt
            try:
                ids = await state.run_tokenizer(lambda: state.llm.tokenizer.encode(text))
            except Exception as exc:
                raise APIError(400, f"cannot tokenize the prompt: {exc}", "prompt") from None
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt is empty", "prompt")
        seqs = await _sequences(state, body, ids, "prompt", body.max_tokens, body.logprobs)
        return await _submit(state, body, seqs)


async def prepare_chat(state: ServerState, body: ChatCompletionRequest, plan: ToolPlan | None) -> ChoiceGroup:
    """A chat completion request's choices, queued on the engine."""
    _check_common(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    _check_sizes(body)
    with _queue_place(state, body.n or 1):
        ids = await _chat_prompt_ids(state, body, plan)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        seqs = await _sequences(state, body, ids, "messages", max_tokens, logprobs, plan)
        return await _submit(state, body, seqs)


def check_message_count(messages: list[Any]) -> None:
    """A conversation longer than MAX_MESSAGES is refused before the chat template runs over it."""
    if len(messages) > MAX_MESSAGES:
        raise APIError(400, f"messages has {len(messages)} entries; at most {MAX_MESSAGES} are allowed", "messages")


def _check_sizes(body: ChatCompletionRequest) -> None:
    """The bounds on a conversation's size that the body limit leaves too loose for the chat template."""
    check_message_count(body.messages)
    for i, tool in enumerate(body.tools or ()):
        size = len(tool.model_dump_json(exclude_none=True))
        if size > MAX_TOOL_BYTES:
            raise APIError(400, f"tools[{i}] ({tool.function.name!r}) is {size} bytes as JSON; a tool's definition "
                                f"may take at most {MAX_TOOL_BYTES} bytes", "tools")


@contextmanager
def _queue_place(state: ServerState, n: int) -> Iterator[None]:
    """Hold `n` places in the engine's queue while the request is tokenized, compiled and queued: the check
    comes before any of that work (a 429 then costs none of it), and requests being prepared count as waiting,
    less those that free rows take at the next step. The check reads the engine thread's state as it stands (a
    snapshot); the engine's own check, when it queues them, stays the final word."""
    engine = state.engine.engine
    queue = engine.max_waiting
    if queue is not None:
        if n > queue:  # could never be queued: a 429 would be retried forever
            raise APIError(400, f"n ({n}) exceeds the requests this server queues at once ({queue})", "n")
        free_rows = engine.max_num_seqs - len(engine.running) - (engine.prefilling is not None)
        waiting = max(0, len(engine.waiting) + state.preparing - max(0, free_rows))
        if waiting + n > queue:
            raise _busy(f"{waiting} requests already waiting")
    state.preparing += n
    try:
        yield
    finally:
        state.preparing -= n


def _busy(why: str) -> APIError:
    return APIError(429, f"the server is busy ({why}); retry later", None, "rate_limit_exceeded",
                    {"Retry-After": str(RETRY_AFTER_S)})


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


async def _sequences(state: ServerState, body: ChatCompletionRequest | CompletionRequest, ids: list[int],
                     prompt_field: str, max_tokens: int | None, logprobs: int | None,
                     plan: ToolPlan | None = None) -> list[Sequence]:
    """The request's `n` sequences: one prompt, one prefill group, choice i seeded with seed + i (under
    structured outputs or a tool grammar, the grammar is compiled once, off the event loop, and each choice
    follows it with its own copy of the matcher)."""
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
    tools = tool_grammar(plan) if plan is not None else None
    kwargs["structured_outputs"] = structured = structured_params(body, tools)
    kwargs["logprobs"] = logprobs
    kwargs["min_tokens"] = body.min_tokens or 0
    kwargs["logit_bias"] = _logit_bias(state, body.logit_bias)
    n = body.n or 1
    if n > 1:  # distinct choices, reproducible with a seed
        base = body.seed if body.seed is not None else secrets.randbits(62)
        seeds = [base + i if base + i <= SEED_MAX else base - i for i in range(n)]
    try:
        params = SamplingParams(max_tokens=max_tokens, **kwargs)
    except ValueError as exc:
        raise _field_error(exc, prompt_field) from None
    if structured is not None:
        await compile_constraint(structured, constraint_field(body, tools), state.llm.tokenizer, state.vocab_size)
    try:
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
        raise _field_error(exc, prompt_field) from None


def _field_error(exc: ValueError, prompt_field: str) -> APIError:
    """A 400 naming the sampling field the message starts with, else the prompt."""
    word = str(exc).split(" ", 1)[0]
    return APIError(400, str(exc), word if word in _SAMPLING_FIELDS else prompt_field)


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
    try:
        return ChoiceGroup(await state.engine.add_group(seqs, k_override))
    except QueueFullError as exc:
        raise _busy(str(exc)) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), None, "engine_unavailable",
                       {"Retry-After": str(RETRY_AFTER_S)}) from None
    except ValueError as exc:
        raise APIError(400, str(exc), "max_tokens", "context_length_exceeded") from None
