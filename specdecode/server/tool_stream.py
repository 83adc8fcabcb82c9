"""Streamed tool calls of one chat choice: its text deltas -> OpenAI's chat deltas, content as `content` and
each parsed call as `tool_calls` pieces (a first piece with index, id, type and the function's name, then its
arguments); the choice finishes with "tool_calls" when the model called."""

from __future__ import annotations

from typing import Any

from specdecode.server.tools import Format, ToolCallStream, new_call_id


def call_deltas(index: int, call: dict[str, str]) -> list[dict[str, Any]]:
    """One call as the deltas OpenAI streams: its header, then its arguments."""
    return [
        {"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                         "function": {"name": call["name"], "arguments": ""}}]},
        {"tool_calls": [{"index": index, "function": {"arguments": call["arguments"]}}]},
    ]


class ToolDeltas:
    """One choice's parser: text in (held back while it may be a call), deltas out."""

    def __init__(self, fmt: Format) -> None:
        self.parser = ToolCallStream(fmt)
        self.called = 0
        """Calls sent so far (the next call's index)."""

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas an update's text releases; `final`: the choice's last update (flush what is held)."""
        events = self.parser.feed(text)
        if final:
            events += self.parser.finish()
        out: list[dict[str, Any]] = []
        for kind, value in events:
            if kind == "content":
                out.append({"content": value})
            else:
                out.extend(call_deltas(self.called, value))
                self.called += 1
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.called else reason
