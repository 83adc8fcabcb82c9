"""Bad input never gets a 500 and never kills the server: raw HTTP posts, a full queue, and a fuzzer.

Every refusal is a 4xx with an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402
from server_helpers import API_KEY, LiveServer  # noqa: E402

from specdecode import LLM  # noqa: E402
from specdecode.server.app import build_app  # noqa: E402

NAME = "tiny"
MAX_LEN = 256
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    torch.set_num_threads(1)
    return LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config={"method": "ngram"},
               max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[LiveServer]:
    s = LiveServer(build_app(llm, max_num_seqs=2, max_waiting=4, served_model_name=NAME, api_key=API_KEY)).start()
    yield s
    s.stop()


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "any":
        assert err["param"] == param, err
    return err


def ok_chat(server: LiveServer) -> None:
    r = server.post(CHAT, json={"model": NAME, "messages": MSGS, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


BAD_CHAT: list[tuple[str, dict[str, Any], str | None]] = [
    ("wrong type max_tokens", {"max_tokens": "ten"}, "max_tokens"),
    ("float max_tokens", {"max_tokens": 2.5}, "max_tokens"),
    ("bool max_tokens", {"max_tokens": True}, "max_tokens"),
    ("negative max_tokens", {"max_tokens": -1}, "max_tokens"),
    ("zero max_tokens", {"max_tokens": 0}, "max_tokens"),
    ("absurd max_tokens", {"max_tokens": 10**30}, "max_tokens"),
    ("too many tokens for the context", {"max_tokens": MAX_LEN}, "max_tokens"),
    ("absurd temperature", {"temperature": 1e9}, "temperature"),
    ("negative temperature", {"temperature": -0.5}, "temperature"),
    ("string temperature", {"temperature": "hot"}, "temperature"),
    ("top_p 0", {"top_p": 0}, "top_p"),
    ("top_p 2", {"top_p": 2}, "top_p"),
    ("top_k -5", {"top_k": -5}, "top_k"),
    ("min_p 2", {"min_p": 2}, "min_p"),
    ("repetition_penalty 0", {"repetition_penalty": 0}, "repetition_penalty"),
    ("presence_penalty 5", {"presence_penalty": 5}, "presence_penalty"),
    ("frequency_penalty -9", {"frequency_penalty": -9}, "frequency_penalty"),
    ("huge seed", {"seed": 2**70}, "seed"),
    ("stop as number", {"stop": 5}, "stop"),
    ("too many stops", {"stop": [str(i) for i in range(40)]}, "stop"),
    ("stream as string", {"stream": "yes"}, "stream"),
    ("n 99", {"n": 99}, "n"),
    ("n over the queue", {"n": 5}, "n"),
    ("unknown model", {"model": "gpt-4o"}, "model"),
    ("model as number", {"model": 3}, "model"),
    ("empty messages", {"messages": []}, "messages"),
    ("messages as string", {"messages": "hi"}, "messages"),
    ("message without role", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("content as number", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("message not an object", {"messages": ["hi"]}, "messages[0]"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs 21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("logit_bias key not an id", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("logit_bias beyond the vocabulary", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("logit_bias 101", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("min_tokens above max_tokens", {"min_tokens": 9}, "min_tokens"),
    ("speculative k -1", {"speculative": {"num_speculative_tokens": -1}}, "speculative.num_speculative_tokens"),
    ("speculative k 99", {"speculative": {"num_speculative_tokens": 99}}, "speculative.num_speculative_tokens"),
    ("speculative not an object", {"speculative": "fast"}, "speculative"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("stop token id negative", {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
]


@pytest.mark.parametrize("case", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_fields(server: LiveServer, case: tuple[str, dict[str, Any], str | None]) -> None:
    _, patch, param = case
    body = {"model": NAME, "messages": MSGS, "max_tokens": 4, **patch}
    err = assert_error(server.post(CHAT, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


BAD_COMPLETIONS: list[tuple[str, dict[str, Any], str | None]] = [
    ("missing prompt", {"prompt": None}, "prompt"),
    ("prompt as number", {"prompt": 5}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("empty token list", {"prompt": []}, "prompt"),
    ("token id beyond the vocabulary", {"prompt": [1, 2, 10**6]}, "prompt"),
    ("negative token id", {"prompt": [1, -2]}, "prompt"),
    ("two prompts", {"prompt": ["a", "b"]}, "prompt"),
    ("prompt longer than the context", {"prompt": [5] * (MAX_LEN + 10)}, "prompt"),
    ("prompt + max_tokens over the context", {"prompt": [5] * (MAX_LEN - 10), "max_tokens": 20}, "max_tokens"),
    ("echo", {"echo": True}, "echo"),
    ("logprobs 21", {"logprobs": 21}, "logprobs"),
    ("best_of", {"best_of": 3}, "best_of"),
]


# Fields OpenAI defines that this server does not implement, and fields nobody defines: each is a 400 naming it.
UNRECOGNIZED: list[tuple[str, Any]] = [
    ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"),
    ("parallel_tool_calls", False),
    ("functions", [{"name": "f"}]),
    ("modalities", ["text"]),
    ("no_such_field", 1),
]


@pytest.mark.parametrize("case", UNRECOGNIZED, ids=[c[0] for c in UNRECOGNIZED])
def test_unrecognized_fields_are_named(server: LiveServer, case: tuple[str, Any]) -> None:
    field, value = case
    body = {"model": NAME, "messages": MSGS, "max_tokens": 4, field: value}
    err = assert_error(server.post(CHAT, json=body), 400, field)
    assert err["message"] == f"Unrecognized request argument supplied: {field}"
    body = {"model": NAME, "prompt": "hello", "max_tokens": 4, field: value}
    assert_error(server.post(COMPLETIONS, json=body), 400, field)


def test_unrecognized_nested_fields_are_named(server: LiveServer) -> None:
    msgs = [{"role": "user", "content": "hi", "tool_call_id": "x"}]
    err = assert_error(server.post(CHAT, json={"model": NAME, "messages": msgs}), 400, "messages[0].tool_call_id")
    assert "Unrecognized request argument" in err["message"]
    body = {"model": NAME, "messages": MSGS, "speculative": {"k": 3}}
    assert_error(server.post(CHAT, json=body), 400, "speculative.k")


def test_metadata_fields_change_nothing(server: LiveServer) -> None:
    body = {"model": NAME, "messages": MSGS, "max_tokens": 3, "temperature": 0}
    plain = server.post(CHAT, json=body)
    tagged = server.post(CHAT, json={**body, "user": "u1", "metadata": {"team": "a"}, "store": False,
                                     "service_tier": "auto"})
    assert plain.status_code == tagged.status_code == 200, (plain.text, tagged.text)
    assert plain.json()["choices"][0]["message"] == tagged.json()["choices"][0]["message"]
    r = server.post(COMPLETIONS, json={"model": NAME, "prompt": "hi", "max_tokens": 2, "user": "u1", "store": True})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("case", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_fields(server: LiveServer, case: tuple[str, dict[str, Any], str | None]) -> None:
    _, patch, param = case
    body = {k: v for k, v in {"model": NAME, "prompt": "hello", "max_tokens": 4, **patch}.items() if v is not None}
    assert_error(server.post(COMPLETIONS, json=body), 400, param)


RAW_BODIES = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', None),
    ("not JSON at all", b"hello there", None),
    ("empty body", b"", None),
    ("array body", b"[1, 2, 3]", None),
    ("null body", b"null", None),
    ("NaN temperature", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    ("Infinity top_p", b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', "top_p"),
    ("overflowing temperature", b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
     "temperature"),
    ("lone surrogate", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("deeply nested", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
]


@pytest.mark.parametrize("case", RAW_BODIES, ids=[c[0] for c in RAW_BODIES])
def test_raw_bodies(server: LiveServer, case: tuple[str, bytes, str | None]) -> None:
    _, raw, param = case
    for content_type in ("application/json", "text/plain"):
        r = server.post(CHAT, content=raw, headers={"Content-Type": content_type})
        assert_error(r, 400, param)


def test_lone_surrogate_prompt(server: LiveServer) -> None:
    raw = b'{"prompt": "x\\ud800", "max_tokens": 2}'
    assert_error(server.post(COMPLETIONS, content=raw, headers={"Content-Type": "application/json"}), 400, "prompt")


def test_oversized_bodies_are_refused(server: LiveServer) -> None:
    big = json.dumps({"model": NAME, "prompt": "x" * (2 << 20), "max_tokens": 1}).encode()
    assert_error(server.post(COMPLETIONS, content=big, headers={"Content-Type": "application/json"}), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        for _ in range(40):
            yield b" " * 65536

    r = httpx.post(server.base_url + COMPLETIONS, content=chunks(), headers=server.headers, timeout=30)
    assert_error(r, 413)
    ok_chat(server)


def test_auth_paths_and_methods(server: LiveServer) -> None:
    base = server.base_url
    assert_error(httpx.post(base + CHAT, json={"messages": MSGS}), 401)
    assert_error(httpx.post(base + CHAT, json={"messages": MSGS}, headers={"Authorization": API_KEY}), 401)
    assert_error(httpx.get(base + "/metrics", headers={"Authorization": "Bearer " + API_KEY + "x"}), 401)
    assert httpx.get(base + "/health").status_code == 200
    assert_error(httpx.get(base + "/v1/nothing", headers=server.headers), 404)
    assert_error(httpx.get(base + COMPLETIONS, headers=server.headers), 405)


def test_server_survives_and_counts_errors(server: LiveServer) -> None:
    for _ in range(3):
        server.post(CHAT, content=b"{", headers={"Content-Type": "application/json"})
        server.post(CHAT, json={"messages": [], "max_tokens": -3})
    ok_chat(server)
    r = server.post(COMPLETIONS, json={"model": NAME, "prompt": "hi", "max_tokens": 2, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    m = server.metrics()
    assert m['specdecode_request_errors_total{code="400"}'] >= 6
    assert not any(k.startswith("specdecode_request_errors_total") and 'code="5' in k for k in m)
    assert m["specdecode_requests_running"] == 0 and m["specdecode_requests_waiting"] == 0


# ---- a full queue is a 429 with Retry-After -------------------------------------------------------------------


def test_queue_full_is_429_with_retry_after(llm: LLM) -> None:
    engine = llm.batch_engine(max_num_seqs=1, max_waiting=1)
    step = engine.step

    def slow_step() -> Any:
        time.sleep(0.02)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    s = LiveServer(build_app(llm, engine, served_model_name=NAME, api_key=API_KEY)).start()
    try:
        body = {"model": NAME, "prompt": "hello", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}
        opened: list[httpx.Response] = []
        clients = [httpx.Client(base_url=s.base_url, headers=s.headers, timeout=30) for _ in range(2)]
        for c in clients:  # one running, one waiting
            req = c.build_request("POST", COMPLETIONS, json=body)
            opened.append(c.send(req, stream=True))
            assert opened[-1].status_code == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = s.metrics()
            if m["specdecode_requests_running"] == 1 and m["specdecode_requests_waiting"] == 1:
                break
            time.sleep(0.02)
        r = s.post(COMPLETIONS, json={**body, "stream": False})
        assert_error(r, 429)
        assert r.headers["retry-after"] == "1"
        for resp, c in zip(opened, clients, strict=True):
            resp.close()
            c.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            m = s.metrics()
            if m["specdecode_requests_running"] == 0 and m["specdecode_requests_waiting"] == 0:
                break
            time.sleep(0.05)
        assert m["specdecode_requests_running"] == 0 and m["specdecode_requests_waiting"] == 0
        assert m['specdecode_requests_finished_total{finish_reason="abort"}'] == 2
        assert m['specdecode_request_errors_total{code="429"}'] == 1
        ok_chat(s)
    finally:
        s.stop()


def test_engine_failure_is_a_500_not_a_dead_server(llm: LLM) -> None:
    engine = llm.batch_engine(max_num_seqs=2, max_waiting=4)
    step = engine.step
    fail = threading.Event()

    def flaky_step() -> Any:
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected failure")
        return step()

    engine.step = flaky_step  # type: ignore[method-assign]
    s = LiveServer(build_app(llm, engine, served_model_name=NAME, api_key=API_KEY)).start()
    try:
        fail.set()
        r = s.post(CHAT, json={"model": NAME, "messages": MSGS, "max_tokens": 5})
        assert_error(r, 500)
        fail.set()
        r = s.post(CHAT, json={"model": NAME, "messages": MSGS, "max_tokens": 5, "stream": True})
        assert r.status_code == 200 and '"error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
        ok_chat(s)
        m = s.metrics()
        assert m["specdecode_requests_running"] == 0 and m["specdecode_kv_cache_usage"] == 0
        assert m['specdecode_request_errors_total{code="500"}'] == 2
        assert m['specdecode_requests_finished_total{finish_reason="error"}'] == 2
    finally:
        s.stop()


# ---- fuzzing from the server's own OpenAPI schema ----------------------------------------------------------------


def test_schemathesis_finds_no_server_errors(server: LiveServer) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_dict(httpx.get(server.base_url + "/openapi.json",
                                                      headers=server.headers).json())
    statuses: list[int] = []
    operations = ((COMPLETIONS, "POST", 40), (CHAT, "POST", 40), ("/v1/models", "GET", 3),
                  ("/tokenize", "POST", 15), ("/detokenize", "POST", 15))
    for path, method, examples in operations:
        operation = schema[path][method]

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(operation.as_strategy())
        def check(case: Any) -> None:
            response = case.call(base_url=server.base_url, headers=server.headers, timeout=60)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.body, response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        check()
    assert 200 in statuses and 400 in statuses  # the fuzzer reached both the engine and the validators
    ok_chat(server)

