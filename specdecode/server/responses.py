"""The body of a non-streamed answer: every choice collected (the request aborted if its client goes away), then
OpenAI's `text_completion` or `chat.completion` object (each chat choice's tool calls parsed out of its text,
finish_reason "tool_calls" when it called)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request

from specdecode.engine.logprobs import TokenLogprob
from specdecode.server.async_engine import Update
from specdecode.server.choices import ChoiceGroup
from specdecode.server.errors import APIError
from specdecode.server.logprobs_format import chat_logprobs, completion_logprobs
from specdecode.server.state import ServerState
from specdecode.server.tools import ToolPlan, tool_reply


@dataclasses.dataclass
class Collected:
    """One choice of a non-streamed answer."""

    text: str
    final: Update
    logprobs: list[TokenLogprob]


def logprobs_formatter(state: ServerState, kind: str) -> Callable[[int, list[TokenLogprob]], dict[str, Any]]:
    """(choice index, new tokens' logprobs) -> the choice's logprobs object: chat's or completions' (whose
    text offsets run on across a choice's chunks)."""
    if kind == "chat":
        return lambda i, entries: chat_logprobs(entries, state.token_text)
    offsets: dict[int, int] = {}

    def completion(i: int, entries: list[TokenLogprob]) -> dict[str, Any]:
        out = completion_logprobs(entries, state.token_text, offsets.get(i, 0))
        offsets[i] = offsets.get(i, 0) + sum(len(t) for t in out["tokens"])
        return out

    return completion


async def collect(group: ChoiceGroup, request: Request) -> list[Collected]:
    """Wait for every choice's whole answer; abort them all if the client disconnects meanwhile."""

    async def gather() -> list[Collected]:
        parts: list[list[str]] = [[] for _ in group.streams]
        logprobs: list[list[TokenLogprob]] = [[] for _ in group.streams]
        finals: list[Update | None] = [None] * len(group.streams)
        async for i, update in group.updates():
            parts[i].append(update.text)
            logprobs[i] += update.logprobs or []
            if update.finished or update.error is not None:
                finals[i] = update
        if any(f is None for f in finals):  # pragma: no cover
            raise RuntimeError("stream ended without a final update")
        return [Collected("".join(p), f, lp) for p, f, lp in zip(parts, finals, logprobs, strict=True)
                if f is not None]

    async def disconnected() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    gatherer = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({gatherer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not gatherer.done():
            raise APIError(499, "client disconnected")
        choices = gatherer.result()
        for c in choices:
            if c.final.error is not None:
                raise APIError(500, c.final.error, None, "engine_error")
        return choices
    finally:
        for task in (gatherer, watcher):
            task.cancel()
        group.close()


def completion_response(state: ServerState, rid: str, choices: list[Collected], group: ChoiceGroup,
                        logprobs: bool) -> dict[str, Any]:
    """The text_completion body of a non-streamed request's choices."""
    fmt = logprobs_formatter(state, "completion")
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
        "choices": [{"index": i, "text": c.text, "logprobs": fmt(i, c.logprobs) if logprobs else None,
                     "finish_reason": c.final.finish_reason} for i, c in enumerate(choices)],
        "usage": group.usage([c.final for c in choices]),
    }


def chat_response(state: ServerState, rid: str, choices: list[Collected], group: ChoiceGroup, plan: ToolPlan | None,
                  logprobs: bool) -> dict[str, Any]:
    """The chat.completion body of a non-streamed request's choices."""
    fmt = logprobs_formatter(state, "chat")
    out = []
    for i, c in enumerate(choices):
        message, finish = tool_reply(c.text, c.final.finish_reason, plan)
        out.append({"index": i, "message": message, "logprobs": fmt(i, c.logprobs) if logprobs else None,
                    "finish_reason": finish})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
            "choices": out, "usage": group.usage([c.final for c in choices])}
