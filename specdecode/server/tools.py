"""Tool calling on chat completions: the prompt (through the model's chat template), the grammar that
enforces `required` / a named function, and parsing the model's calls out of its text.

Two output formats: Hermes / Qwen2.5 (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, also
used for templates that know nothing of tools, with the tools described in a system message), and
Llama 3.x JSON (`{"name": ..., "parameters": {...}}`, for templates that render tools that way). Small Hermes-format
models sometimes answer with the bare call object and no tags; an output that is exactly one such object (keys
`name` and `arguments`/`parameters` only) is taken as a call too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from specdecode.server.errors import APIError
from specdecode.server.protocol import ChatCompletionRequest, ChatMessage
from specdecode.structured import StructuredOutputsParams
from specdecode.structured.matcher import JSON_STYLE

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
Format = Literal["hermes", "llama"]

_HERMES_SYSTEM = (
    "# Tools\n\nYou may call these functions:\n<tools>{tools}\n</tools>\n\nTo call one, reply with "
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


@dataclass
class ToolPlan:
    """How one request uses its tools."""

    tools: list[dict[str, Any]]
    """OpenAI tool objects, as the chat template reads them."""
    mode: Literal["auto", "required", "named"]
    name: str | None
    """The function a named tool_choice forces."""
    fmt: Format
    in_template: bool
    """The model's chat template renders tools, calls and tool results itself."""
    tags: tuple[str, str] = (json.dumps(OPEN), json.dumps(CLOSE))
    """The grammar's spelling of the call tags: a string, or `<[id]>` where the tokenizer has the tag as one
    added token (Qwen2.5), which the grammar engine matches as a token, not as text."""

    def functions(self) -> list[dict[str, Any]]:
        fns = [t["function"] for t in self.tools]
        return [f for f in fns if f["name"] == self.name] if self.mode == "named" else fns


def template_format(chat_template: str | None) -> tuple[Format, bool]:
    """(output format, whether the template renders tools) from the template's text."""
    text = chat_template or ""
    if OPEN in text:
        return "hermes", True
    if "tools" in text and ("parameters" in text or "python_tag" in text):
        return "llama", True
    return "hermes", False


def _tag(hf: Any, tag: str) -> str:
    """A tag as the grammar spells it: its added token's id, or the text."""
    added = {t.content: i for i, t in (getattr(hf, "added_tokens_decoder", None) or {}).items()}
    return f"<[{added[tag]}]>" if tag in added else json.dumps(tag)


def tool_plan(body: ChatCompletionRequest, hf_tokenizer: Any) -> ToolPlan | None:
    """None when the request has no tools or tool_choice "none" (the model then answers in text)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t["function"]["name"] for t in tools]
    name = None
    if choice is None or choice == "auto":
        mode = "auto"
    elif choice == "required":
        mode = "required"
    else:
        mode, name = "named", choice.function.name
        if name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                           "tool_choice")
    fmt, in_template = template_format(getattr(hf_tokenizer, "chat_template", None))
    tags = (_tag(hf_tokenizer, OPEN), _tag(hf_tokenizer, CLOSE))
    return ToolPlan(tools, mode, name, fmt, in_template, tags)  # type: ignore[arg-type]


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_text(name: str, arguments: str, fmt: Format) -> str:
    key = "parameters" if fmt == "llama" else "arguments"
    return json.dumps({"name": name, key: _arguments(arguments)}, ensure_ascii=False)


def chat_messages(messages: list[ChatMessage], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it; without template support for tools, calls and tool
    results are written into the text (Hermes style) and the tools into a system message."""
    native = plan is None or plan.in_template
    fmt: Format = plan.fmt if plan is not None else "hermes"
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.text()
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"messages[{i}].content is not valid Unicode (a lone surrogate escape)",
                           f"messages[{i}].content") from None
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.role == "tool":
            if native:
                msg.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v})
            else:
                msg = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        elif m.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                     for c in m.tool_calls]
            if native:
                msg["tool_calls"] = calls
            else:
                texts = [f"{OPEN}\n{_call_text(c.function.name, c.function.arguments, fmt)}\n{CLOSE}"
                         for c in m.tool_calls]
                msg["content"] = "\n".join([content, *texts] if content else texts)
        out.append(msg)
    if plan is not None and not plan.in_template:
        described = _HERMES_SYSTEM.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in plan.tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def call_schema(functions: list[dict[str, Any]], fmt: Format) -> dict[str, Any]:
    """The JSON schema of one call to any of `functions`: its name and arguments valid for its parameters."""
    key = "parameters" if fmt == "llama" else "arguments"
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 key: f.get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_STYLE}


def tool_grammar(plan: ToolPlan) -> StructuredOutputsParams | None:
    """`required` / named: exactly one call, in the model's format, whose arguments follow the schema."""
    if plan.mode == "auto":
        return None
    schema = json.dumps(call_schema(plan.functions(), plan.fmt), ensure_ascii=False)
    if plan.fmt == "llama":
        return StructuredOutputsParams(grammar=f"start: call\ncall: %json {schema}")
    start, end = plan.tags
    return StructuredOutputsParams(grammar=f'start: {start} "\\n" call "\\n" {end}\ncall: %json {schema}')


# ---- parsing ---------------------------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(obj: Any) -> dict[str, str] | None:
    """{"name", "arguments" | "parameters"} -> {"name", "arguments": JSON text}, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _arguments(args)
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _parse_json_calls(text: str) -> list[dict[str, str]] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_as_call(o) for o in objs]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _bare_call(text: str) -> list[dict[str, str]] | None:
    """A whole output that is one untagged call object, as small Hermes-format models write it; else None."""
    body = text.strip()
    if not body.startswith("{"):
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not set(obj) <= {"name", "arguments", "parameters"} or "name" not in obj:
        return None
    call = _as_call(obj)
    return [call] if call is not None else None


_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def parse_tool_calls(text: str, fmt: Format) -> tuple[str | None, list[dict[str, str]]]:
    """(content left, calls as {"name", "arguments"}) from a whole output; unparsable calls stay text."""
    if fmt == "llama":
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        calls = _parse_json_calls(body) if body.startswith(("{", "[")) else None
        return (None, calls) if calls else (text, [])
    calls: list[dict[str, str]] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        parsed = _parse_json_calls(m.group(1).strip())
        kept.append(text[pos : m.start()] if parsed else text[pos : m.end()])
        calls.extend(parsed or [])
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept)
    if calls:
        return (content.strip() or None), calls
    bare = _bare_call(text)
    return (None, bare) if bare else (text, [])


@dataclass
class ToolCallStream:
    """Streamed text -> content pieces and whole calls, as the text arrives (a call is emitted once its
    closing tag, or the end of the output, is seen)."""

    fmt: Format
    buf: str = ""
    inside: bool = False
    mode: Literal["undecided", "json", "text"] = "undecided"
    """Whether the output opens as a JSON object (a Llama call, or an untagged Hermes one: held to the end) or
    as text (streamed)."""
    calls: int = 0

    def feed(self, text: str) -> list[tuple[str, Any]]:
        """("content", str) and ("call", {"name", "arguments"}) events for the new text."""
        self.buf += text
        return self._llama(final=False) if self.fmt == "llama" else self._hermes(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        return self._llama(final=True) if self.fmt == "llama" else self._hermes(final=True)

    def _content(self, out: list[tuple[str, Any]], text: str) -> None:
        if text and (not self.calls or text.strip()):
            out.append(("content", text))

    def _hermes(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.mode == "undecided":
            head = self.buf.lstrip()
            if not head and not final:
                return out
            self.mode = "json" if head.startswith("{") else "text"
        if self.mode == "json":  # maybe an untagged call: held whole, parsed at the end
            if not final:
                return out
            self.mode = "text"
            bare = _bare_call(self.buf)
            if bare:
                out.extend(("call", c) for c in bare)
                self.calls += len(bare)
                self.buf = ""
                return out
        while True:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i >= 0:
                    self._content(out, self.buf[:i])
                    self.buf, self.inside = self.buf[i + len(OPEN):], True
                    continue
                hold = 0 if final else next((n for n in range(len(OPEN) - 1, 0, -1) if self.buf.endswith(OPEN[:n])), 0)
                self._content(out, self.buf[: len(self.buf) - hold])
                self.buf = self.buf[len(self.buf) - hold:]
                return out
            j = self.buf.find(CLOSE)
            if j < 0 and not final:
                return out
            block = self.buf if j < 0 else self.buf[:j]
            calls = _parse_json_calls(block.strip())
            if calls:
                out.extend(("call", c) for c in calls)
                self.calls += len(calls)
            else:
                self._content(out, OPEN + block + ("" if j < 0 else CLOSE))
            self.buf, self.inside = ("" if j < 0 else self.buf[j + len(CLOSE):]), False
            if j < 0:
                return out

    def _llama(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.mode == "undecided":
            head = self.buf.lstrip()
            if head.startswith(("{", "[", PYTHON_TAG)):
                self.mode = "json"
            elif head and not PYTHON_TAG.startswith(head):
                self.mode = "text"
            elif not final:
                return out
        if self.mode == "text" or (self.mode == "undecided" and final):
            self._content(out, self.buf)
            self.buf = ""
        elif final:
            _, calls = parse_tool_calls(self.buf, "llama")
            if calls:
                out.extend(("call", c) for c in calls)
                self.calls += len(calls)
            else:
                self._content(out, self.buf)
            self.buf = ""
        return out


def tool_reply(text: str, finish_reason: str | None, plan: ToolPlan | None) -> tuple[dict[str, Any], str | None]:
    """The chat message of a whole output and its finish reason ("tool_calls" when the model called)."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_tool_calls(text, plan.fmt)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    tool_calls = [{"id": new_call_id(), "type": "function", "function": c} for c in calls]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"
