"""The SSE stream of a `stream: true` request: chat's `chat.completion.chunk` or completions' `text_completion`
events, each choice's tokens as they come, then the usage (if asked) and `[DONE]`. A stream that fails (the
engine) or runs past its deadline ends with an error event (`{"error": {...}}`), then `[DONE]`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specdecode.engine.logprobs import TokenLogprob
from specdecode.server.async_engine import Update
from specdecode.server.choices import ChoiceGroup
from specdecode.server.deadline import Deadline
from specdecode.server.errors import error_body
from specdecode.server.protocol import SpeculativeUsage
from specdecode.server.responses import logprobs_formatter
from specdecode.server.state import ServerState
from specdecode.server.tool_stream import ToolDeltas
from specdecode.server.tools import ToolPlan


class SSEResponse(StreamingResponse):
    """A streaming response that aborts its request's choices however the stream ends (done, disconnect, cancel)."""

    def __init__(self, content: AsyncIterator[str], stream: ChoiceGroup) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def chat_events(state: ServerState, group: ChoiceGroup, rid: str, include_usage: bool, plan: ToolPlan | None,
                deadline: Deadline | None = None) -> AsyncIterator[str]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": state.model_name}
    # Chat streams open with the role, send text as deltas, and finish with an empty delta.
    return _events(state, group, base, include_usage, lambda text: {"delta": {} if text is None else
                                                                    {"content": text}},
                   opening={"delta": {"role": "assistant", "content": ""}}, final_carries_text=False,
                   logprobs=logprobs_formatter(state, "chat"),
                   tools=None if plan is None else [ToolDeltas(plan.fmt) for _ in group.streams], deadline=deadline)


def completion_events(state: ServerState, group: ChoiceGroup, rid: str, include_usage: bool,
                      deadline: Deadline | None = None) -> AsyncIterator[str]:
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    # Completion streams carry the last piece of text in the chunk that finishes.
    return _events(state, group, base, include_usage, lambda text: {"text": text or ""},
                   opening=None, final_carries_text=True, logprobs=logprobs_formatter(state, "completion"),
                   deadline=deadline)


def _events(
    state: ServerState,
    group: ChoiceGroup,
    base: dict[str, Any],
    include_usage: bool,
    payload: Callable[[str | None], dict[str, Any]],
    opening: dict[str, Any] | None,
    final_carries_text: bool,
    logprobs: Callable[[int, list[TokenLogprob]], dict[str, Any]],
    tools: list[ToolDeltas] | None = None,
    deadline: Deadline | None = None,
) -> AsyncIterator[str]:
    """SSE events of one streamed request, shared by chat and completions (they differ only in how a
    choice holds text); each choice's chunks carry its index, a choice's next chunk the logprobs of its
    tokens not yet sent. With tools, each choice's text goes through its own tool-call parser. Past the
    deadline the stream ends with a 408 error event (the response's end aborts the choices)."""

    def chunk(i: int, fields: dict[str, Any], finish: str | None = None, lp: Any = None, **extra: Any) -> str:
        obj = {**base, "choices": [{"index": i, **fields, "logprobs": lp, "finish_reason": finish}]}
        if include_usage:
            obj["usage"] = None
        return _sse({**obj, **extra})

    held: list[list[TokenLogprob] | None] = [None] * len(group.streams)  # logprobs of text not yet sent

    def take(i: int) -> dict[str, Any] | None:
        entries, held[i] = held[i], None
        return None if entries is None else logprobs(i, entries)

    def pieces(i: int, update: Update) -> list[dict[str, Any]]:
        if tools is not None:  # a call's text is held back until the call is whole
            return [{"delta": d} for d in tools[i].feed(update.text, update.finished)]
        if not update.text or (update.finished and final_carries_text):
            return []
        return [payload(update.text)]

    async def events() -> AsyncIterator[str]:
        if opening is not None:
            for i in range(len(group.streams)):
                yield chunk(i, opening)
        finals: list[Update] = []
        updates = group.updates()
        while True:
            try:
                async with asyncio.timeout_at(deadline.at if deadline is not None else None):
                    i, update = await anext(updates)
            except StopAsyncIteration:
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": group.usage(finals)})
                break
            except TimeoutError:
                if deadline is None:  # pragma: no cover - no timer to expire
                    raise
                state.metrics.request_errors.labels(code="408").inc()
                yield _sse(deadline.event_body())
                break
            if update.error is not None:
                state.metrics.request_errors.labels(code="500").inc()
                yield _sse(error_body(500, update.error, None, "engine_error"))
                break
            if update.logprobs is not None:
                held[i] = (held[i] or []) + update.logprobs
            for fields in pieces(i, update):
                yield chunk(i, fields, lp=take(i))
            if update.finished:
                finals.append(update)
                spec = SpeculativeUsage.from_stats(update.stats)
                finish = update.finish_reason if tools is None else tools[i].finish_reason(update.finish_reason)
                yield chunk(i, payload(update.text if final_carries_text else None), finish, take(i),
                            speculative=spec.model_dump() if spec else None)
        yield "data: [DONE]\n\n"

    return events()
