"""Structured outputs and tool calls through the official `openai` client against a real server on loopback.

A tiny random fp32 Llama (context raised to 2048) served four ways: plain, prompt lookup, and a draft
model that is the target itself (fixed k=3), drafting chains or trees. Its text is grammar-driven noise,
so what is checked is what the grammar guarantees: every output parses and validates against its
schema, and greedy outputs with speculation equal those without. Tool calls under `required` and a named
choice validate against the tool's schema, and streamed deltas reassemble to the same call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("llguidance")
pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from conftest import make_tiny_hf_dir  # noqa: E402
from server_helpers import API_KEY, LiveServer  # noqa: E402

from specdecode import LLM  # noqa: E402
from specdecode.server.app import build_app  # noqa: E402

NAME = "tiny"
MAX_LEN = 2048
S = {"type": "string", "maxLength": 6}
I = {"type": "integer", "minimum": -50, "maximum": 50}  # noqa: E741
N = {"type": "number", "minimum": 0, "maximum": 10}


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS: list[dict[str, Any]] = [
    obj({"a": I}),
    obj({"name": S, "age": I}),
    obj({"x": N, "y": N}),
    obj({"flag": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    obj({"nums": {"type": "array", "items": I, "minItems": 1, "maxItems": 4}}),
    obj({"inner": obj({"k": S})}),
    obj({"a": obj({"b": obj({"c": I})})}),
    obj({"a": I, "b": S}, required=["a"]),
    obj({"opt": S, "req": {"type": "boolean"}}, required=["req"]),
    obj({"items": {"type": "array", "items": obj({"id": I, "ok": {"type": "boolean"}}), "maxItems": 2}}),
    obj({"kind": {"const": "point"}, "x": I}),
    obj({"v": {"anyOf": [I, S]}}),
    obj({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    obj({"ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}),
    obj({"maybe": {"type": ["string", "null"], "maxLength": 4}}),
    {"type": "array", "items": obj({"n": I}), "minItems": 1, "maxItems": 2},
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    obj({"user": obj({"name": S, "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2}}),
         "active": {"type": "boolean"}}),
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": obj({"city": S, "unit": {"enum": ["c", "f"]}}, ["city"])}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": obj({"a": I, "b": I})}},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_long"), "llama", seed=0)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = MAX_LEN  # room for tool descriptions in the byte-level tiny vocabulary
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _serve(model_dir: Path, spec: dict[str, Any] | None) -> LiveServer:
    torch.set_num_threads(1)
    llm = LLM(str(model_dir), dtype="fp32", device="cpu", speculative_config=spec, max_model_len=MAX_LEN)
    engine = llm.batch_engine(max_num_seqs=4, max_waiting=64)
    engine.cost = None  # the fixed k as is (a draft as big as its target never pays by the cost model)
    app = build_app(llm, engine, served_model_name=NAME, api_key=API_KEY)
    return LiveServer(app).start()


@pytest.fixture(scope="module")
def servers(model_dir: Path) -> Iterator[dict[str, LiveServer]]:
    specs = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3},
             "draft": {"method": "draft", "model": str(model_dir), "num_speculative_tokens": 3},
             "tree": {"method": "draft", "model": str(model_dir), "num_speculative_tokens": 3,
                      "draft_tree_width": 2, "draft_tree_branching": 2}}
    live = {name: _serve(model_dir, spec) for name, spec in specs.items()}
    yield live
    for server in live.values():
        server.stop()


def _schema_reply(server: LiveServer, i: int, schema: dict[str, Any], accepted: dict[str, int], name: str
                  ) -> tuple[str, str]:
    r = server.openai().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": f"request {i}"}], temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
    accepted[name] = accepted.get(name, 0) + r.usage.model_extra["speculative"]["accepted_tokens"]
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_json_schemas_validate_and_speculation_is_lossless(servers: dict[str, LiveServer]) -> None:
    accepted: dict[str, int] = {}
    for i, schema in enumerate(SCHEMAS):
        replies = {name: _schema_reply(s, i, schema, accepted, name) for name, s in servers.items()}
        text, finish = replies["plain"]
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)
        assert replies["ngram"] == replies["plain"], i
        assert replies["draft"] == replies["plain"], i
        assert replies["tree"] == replies["plain"], i
    # Speculation ran and paid: forced tokens ride along every chain, and the draft drafts within the grammar.
    assert accepted["ngram"] > 100 and accepted["draft"] > 200, accepted


def test_vllm_spellings_and_completions(servers: dict[str, LiveServer]) -> None:
    client = servers["ngram"].openai()
    chat = dict(model=NAME, messages=[{"role": "user", "content": "pick"}], temperature=0, max_tokens=40)
    r = client.chat.completions.create(**chat, extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert r.choices[0].message.content in ("alpha", "beta", "gamma")
    r = client.chat.completions.create(**chat, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].message.content)
    r = client.chat.completions.create(**chat, extra_body={"structured_outputs": {"grammar": 'start: "ok" | "no"'}})
    assert r.choices[0].message.content in ("ok", "no")
    r = client.chat.completions.create(**chat, extra_body={"guided_grammar": 'root ::= "yes" | "maybe"'})  # GBNF
    assert r.choices[0].message.content in ("yes", "maybe")
    r = client.chat.completions.create(**chat, extra_body={"guided_json": SCHEMAS[1]})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[1])
    r = client.chat.completions.create(**{**chat, "max_tokens": 200}, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    plain = client.chat.completions.create(**chat).choices[0].message.content
    assert client.chat.completions.create(**chat, response_format={"type": "text"}).choices[0].message.content == plain
    c = client.completions.create(model=NAME, prompt="x =", temperature=0, max_tokens=40,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "s", "schema": SCHEMAS[4]}}})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMAS[4])


def test_bad_structured_requests_are_400(servers: dict[str, LiveServer]) -> None:
    server = servers["plain"]
    base = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
    bad = [({"guided_regex": "(("}, None), ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
           ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex")]
    for extra, param in bad:
        r = server.post("/v1/chat/completions", json={**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        if param is not None:
            assert r.json()["error"]["param"] == param, r.text


def _check_call(call: Any, name: str | None = None) -> None:
    fn = {t["function"]["name"]: t["function"] for t in TOOLS}
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in fn and (name is None or call.function.name == name)
    jsonschema.validate(json.loads(call.function.arguments), fn[call.function.name]["parameters"])


@pytest.mark.parametrize("choice", ["required", "get_weather", "add"])
def test_required_and_named_tool_calls(servers: dict[str, LiveServer], choice: str) -> None:
    tool_choice: Any = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    for name in ("plain", "ngram"):
        client = servers[name].openai()
        req = dict(model=NAME, messages=[{"role": "user", "content": "what is the weather in Paris?"}],
                   tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=120)
        r = client.chat.completions.create(**req)
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = r.choices[0].message.tool_calls
        _check_call(call, None if choice == "required" else choice)
        chunks = list(client.chat.completions.create(**req, stream=True))
        pieces: dict[int, dict[str, str]] = {}
        for ch in chunks:
            for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                got = pieces.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert pieces == {0: {"name": call.function.name, "arguments": call.function.arguments}}


def test_tool_conversation_is_accepted(servers: dict[str, LiveServer]) -> None:
    messages = [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    r = servers["plain"].openai().chat.completions.create(model=NAME, messages=messages, tools=TOOLS,
                                                          temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _choices(server: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def test_json_schema_with_logprobs_and_n_choices(servers: dict[str, LiveServer]) -> None:
    schema = SCHEMAS[1]
    body = {"model": NAME, "messages": [{"role": "user", "content": "a person"}], "temperature": 0, "max_tokens": 60,
            "n": 2, "logprobs": True, "top_logprobs": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    spec = _choices(servers["ngram"], body)
    off = _choices(servers["ngram"], {**body, "speculative": {"num_speculative_tokens": 0}})
    assert len(spec) == len(off) == 2
    for a, b in zip(spec, off, strict=True):
        assert a["finish_reason"] == "stop", a
        jsonschema.validate(json.loads(a["message"]["content"]), schema)  # each choice ran its own matcher
        assert a["message"] == b["message"]
        got, want = a["logprobs"]["content"], b["logprobs"]["content"]
        assert [e["token"] for e in got] == [e["token"] for e in want]
        # Read after the grammar's mask: every chosen token is its position's most likely allowed one.
        assert all(e["logprob"] == e["top_logprobs"][0]["logprob"] for e in got)
        assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-4)


def test_tool_calls_per_choice(servers: dict[str, LiveServer]) -> None:
    req = dict(model=NAME, messages=[{"role": "user", "content": "add 2 and 3"}], tools=TOOLS, tool_choice="required",
               temperature=0.8, seed=3, max_tokens=120, n=2)
    client = servers["ngram"].openai()
    r = client.chat.completions.create(**req)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        [call] = c.message.tool_calls
        _check_call(call)
    pieces: dict[tuple[int, int], dict[str, str]] = {}
    finish = {}
    for ch in client.chat.completions.create(**req, stream=True):
        for c in ch.choices:
            for d in c.delta.tool_calls or []:
                got = pieces.setdefault((c.index, d.index), {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert pieces == {(i, 0): {"name": c.message.tool_calls[0].function.name,
                               "arguments": c.message.tool_calls[0].function.arguments}
                      for i, c in enumerate(r.choices)}  # the same seed: the same calls streamed
