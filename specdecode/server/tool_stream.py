"""SSE events of a streamed chat completion with tools: text deltas as content, each parsed call as
OpenAI's `delta.tool_calls` pieces (a first piece with index, id, type and the function's name, then its
arguments), and finish_reason "tool_calls" when the model called."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from specdecode.server.async_engine import RequestStream
from specdecode.server.protocol import SpeculativeUsage
from specdecode.server.tools import Format, ToolCallStream, new_call_id

if TYPE_CHECKING:
    from specdecode.server.app import _Server


def call_deltas(index: int, call: dict[str, str]) -> list[dict[str, Any]]:
    """One call as the deltas OpenAI streams: its header, then its arguments."""
    return [
        {"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                         "function": {"name": call["name"], "arguments": ""}}]},
        {"tool_calls": [{"index": index, "function": {"arguments": call["arguments"]}}]},
    ]


def tool_events(server: _Server, stream: RequestStream, rid: str, include_usage: bool,
                fmt: Format) -> AsyncIterator[str]:
    from specdecode.server.app import _sse, error_body  # the app imports this module

    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": server.model_name}
    parser = ToolCallStream(fmt)
    called = 0

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        obj = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            obj["usage"] = None
        return _sse({**obj, **extra})

    def render(events: list[tuple[str, Any]]) -> list[str]:
        nonlocal called
        out = []
        for kind, value in events:
            if kind == "content":
                out.append(chunk({"content": value}))
            else:
                out.extend(chunk(d) for d in call_deltas(called, value))
                called += 1
        return out

    async def events() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        async for update in stream:
            if update.error is not None:
                server.metrics.request_errors.labels(code="500").inc()
                yield _sse(error_body(500, update.error, None, "engine_error"))
                break
            for piece in render(parser.feed(update.text)):
                yield piece
            if update.finished:
                for piece in render(parser.finish()):
                    yield piece
                spec = SpeculativeUsage.from_stats(update.stats)
                finish = "tool_calls" if called else update.finish_reason
                yield chunk({}, finish, speculative=spec.model_dump() if spec else None)
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": server.usage(stream, update)})
        yield "data: [DONE]\n\n"

    return events()
