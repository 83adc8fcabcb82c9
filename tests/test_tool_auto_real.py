"""`tool_choice: auto` on a real instruct model: Qwen2.5-Coder-0.5B-Instruct calls a tool when the question needs
one (Hermes `<tool_call>` format, parsed into `tool_calls`), answers in text when it does not, and the streamed
deltas reassemble to the same call, with n-gram speculation on.

Marked `pair`: uses the real 0.5B model (fetched on first use, as tests/test_pair.py does).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("llguidance")
pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from server_helpers import API_KEY, LiveServer  # noqa: E402

from specdecode import LLM  # noqa: E402
from specdecode.server.app import build_app  # noqa: E402

pytestmark = pytest.mark.pair

MODEL = "qwen2.5-coder-0.5b-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    torch.set_num_threads(2)
    llm = LLM(MODEL, dtype="bf16", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              max_model_len=1024)
    engine = llm.batch_engine(max_num_seqs=2, max_waiting=8)
    live = LiveServer(build_app(llm, engine, served_model_name=MODEL, api_key=API_KEY)).start()
    yield live
    live.stop()


def test_auto_calls_the_tool_a_question_needs(server: LiveServer) -> None:
    client = server.openai()
    req = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
               tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=64)
    r = client.chat.completions.create(**req)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert "paris" in args["city"].lower()
    pieces = {"name": "", "arguments": ""}
    chunks = list(client.chat.completions.create(**req, stream=True))
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            pieces["name"] += d.function.name or ""
            pieces["arguments"] += d.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert pieces == {"name": call.function.name, "arguments": call.function.arguments}


def test_auto_answers_in_text_when_no_tool_is_needed(server: LiveServer) -> None:
    r = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a Python one-liner that reverses a string s."}],
        tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=48)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
