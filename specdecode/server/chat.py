"""Chat completions around the engine: the conversation (with its tools) -> prompt ids, and a non-streamed
answer's body (each choice's tool calls parsed out of its text, finish_reason "tool_calls" when it called)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from specdecode.server.choices import ChoiceGroup
from specdecode.server.errors import APIError
from specdecode.server.protocol import ChatCompletionRequest
from specdecode.server.tools import ToolPlan, chat_messages, tool_reply

if TYPE_CHECKING:
    from specdecode.server.app import Collected, _Server


async def chat_prompt_ids(server: _Server, body: ChatCompletionRequest, plan: ToolPlan | None) -> list[int]:
    """The chat template applied to the conversation (and the tools, where the template renders them), on
    the tokenize thread; a conversation the template rejects is a 400."""
    messages = chat_messages(body.messages, plan)
    tools = plan.tools if plan is not None and plan.in_template else None

    def encode() -> list[int]:
        return server.llm.chat_prompt_ids(messages, tools)

    try:
        return await server.run_tokenizer(encode)
    except Exception as exc:  # the model's template may reject a conversation (roles, order)
        raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None


def chat_response(server: _Server, rid: str, choices: list[Collected], group: ChoiceGroup, plan: ToolPlan | None,
                  logprobs: bool) -> dict[str, Any]:
    """The chat.completion body of a non-streamed request's choices."""
    fmt = server.logprobs_formatter("chat")
    out = []
    for i, c in enumerate(choices):
        message, finish = tool_reply(c.text, c.final.finish_reason, plan)
        out.append({"index": i, "message": message, "logprobs": fmt(i, c.logprobs) if logprobs else None,
                    "finish_reason": finish})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": server.model_name,
            "choices": out, "usage": group.usage([c.final for c in choices])}
