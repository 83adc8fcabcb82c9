"""Bounded work before admission: a full queue is a 429 before any tokenizer or grammar work, a grammar compiles
off the event loop within a time limit (past it a 400 naming the field while other requests go on), llguidance
runs under limits below its defaults, and the size bounds on a conversation are 400s naming the bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402
from server_helpers import API_KEY, LiveServer  # noqa: E402

from specdecode import LLM  # noqa: E402
from specdecode.server import engine_requests, structured  # noqa: E402
from specdecode.server.app import build_app  # noqa: E402

NAME = "tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hello"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
          "additionalProperties": False}


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    torch.set_num_threads(1)
    return LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config={"method": "ngram"},
               max_model_len=256)


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[LiveServer]:
    s = LiveServer(build_app(llm, max_num_seqs=2, max_waiting=8, served_model_name=NAME, api_key=API_KEY)).start()
    yield s
    s.stop()


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


# ---- the queue is checked before any tokenizer or grammar work ---------------------------------------------------


def test_full_queue_is_429_before_tokenizing_or_compiling(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"tokenize": 0, "compile": 0}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(llm.tokenizer, "encode", counted("tokenize", llm.tokenizer.encode))
    monkeypatch.setattr(llm, "chat_prompt_ids", counted("tokenize", llm.chat_prompt_ids))
    monkeypatch.setattr(structured, "compiled_grammar", counted("compile", structured.compiled_grammar))
    engine = llm.batch_engine(max_num_seqs=1, max_waiting=1)
    step, held, gate = engine.step, threading.Event(), threading.Event()

    def held_step() -> Any:  # after its first step the engine holds until the test lets it go on
        out = step()
        held.set()
        gate.wait(30)
        return out

    engine.step = held_step  # type: ignore[method-assign]
    s = LiveServer(build_app(llm, engine, served_model_name=NAME, api_key=API_KEY)).start()
    state = s.app.state.server
    pool = ThreadPoolExecutor(2)
    try:
        body = {"model": NAME, "prompt": "hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        first = pool.submit(s.post, COMPLETIONS, json=body)
        wait_for(lambda: held.is_set() and len(engine.running) == 1, "the first request on the only row")
        second = pool.submit(s.post, COMPLETIONS, json=body)
        wait_for(lambda: state.preparing == 1 and calls["tokenize"] >= 2, "the second request on its way in")
        before = dict(calls)
        # The row taken and one request on its way to the queue of 1: refused before any work, whatever the request.
        err = error_of(s.post(COMPLETIONS, json=body), 429)
        assert err["code"] == "rate_limit_exceeded" and "1 requests already waiting" in err["message"]
        r = s.post(CHAT, json={"model": NAME, "messages": MSGS, "max_tokens": 2,
                               "response_format": json_schema(SCHEMA)})
        assert error_of(r, 429) and r.headers["retry-after"] == "1"
        r = s.post(COMPLETIONS, json={**body, "prompt": [1, 2, 3]})
        error_of(r, 429)
        assert calls == before, "a refused request reached the tokenizer or the grammar engine"
        # n beyond the whole queue can never fit: a 400, not a 429 to retry forever.
        assert error_of(s.post(COMPLETIONS, json={**body, "n": 2}), 400)["param"] == "n"
        gate.set()
        assert first.result(30).status_code == 200 and second.result(30).status_code == 200
        assert state.preparing == 0
        assert s.post(COMPLETIONS, json={**body, "max_tokens": 2}).status_code == 200
    finally:
        gate.set()
        pool.shutdown()
        s.stop()


# ---- grammars compile off the event loop, within a time limit ------------------------------------------------------


def test_compile_past_the_time_limit_is_400_and_other_requests_go_on(
        server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_schema = {**SCHEMA, "description": "compiles slowly"}
    started, release = threading.Event(), threading.Event()
    real = structured.compiled_grammar

    def compiled_grammar(params: Any, tokenizer: Any, vocab_size: int) -> Any:
        if params.json is not None and "compiles slowly" in params.json:
            started.set()
            release.wait(30)  # a compile that runs on (its thread cannot be interrupted)
        return real(params, tokenizer, vocab_size)

    monkeypatch.setattr(structured, "compiled_grammar", compiled_grammar)
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.5)
    pool = ThreadPoolExecutor(1)
    try:
        slow = pool.submit(server.post, CHAT, json={"model": NAME, "messages": MSGS, "max_tokens": 4,
                                                    "response_format": json_schema(slow_schema)})
        assert started.wait(20)
        # While that compile runs: a plain request, and one whose grammar compiles on the other thread.
        plain = server.post(CHAT, json={"model": NAME, "messages": MSGS, "max_tokens": 3, "temperature": 0})
        assert plain.status_code == 200, plain.text
        fine = server.post(CHAT, json={"model": NAME, "messages": MSGS, "max_tokens": 8, "temperature": 0,
                                       "response_format": json_schema(SCHEMA)})
        assert fine.status_code == 200, fine.text
        err = error_of(slow.result(20), 400)
        assert not release.is_set()  # answered while its compile still runs
        assert err["param"] == "response_format.json_schema"
        assert "response_format.json_schema is too complex" in err["message"] and "0.5 s" in err["message"]
    finally:
        release.set()
        pool.shutdown()


def test_grammar_past_llguidance_limits_is_400_naming_the_field(
        server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llguidance")
    from specdecode.structured import matcher

    monkeypatch.setitem(matcher.LIMITS, "initial_lexer_fuel", 10)
    schema = {**SCHEMA, "description": "past the limits"}  # not compiled before: no kept grammar to copy
    for extra, param in (({"response_format": json_schema(schema)}, "response_format.json_schema"),
                         ({"guided_regex": "[a-z]{3,40}[0-9]+"}, "guided_regex")):
        r = server.post(CHAT, json={"model": NAME, "messages": MSGS, "max_tokens": 4, **extra})
        err = error_of(r, 400)
        assert err["param"] == param and "too big" in err["message"], err


def test_llguidance_limits_are_below_its_defaults() -> None:
    llguidance = pytest.importorskip("llguidance")
    from specdecode.structured.matcher import LIMITS

    defaults = llguidance.LLParserLimits()
    for name, value in LIMITS.items():
        assert value < getattr(defaults, name), name
    llguidance.LLParserLimits(**LIMITS)  # every name is one llguidance takes


def test_repeated_grammar_compiles_once(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llguidance")
    from specdecode.structured import matcher
    from specdecode.structured.params import StructuredOutputsParams

    compiles = []
    real = matcher.compile_grammar
    monkeypatch.setattr(matcher, "compile_grammar", lambda *a: compiles.append(1) or real(*a))
    params = StructuredOutputsParams(json={**SCHEMA, "description": "kept"})
    vocab = llm.target.config.vocab_size
    first, second = (matcher.build_matcher(params, llm.tokenizer, vocab) for _ in range(2))
    assert len(compiles) == 1
    token = int(first.allowed().nonzero()[0])
    assert first.consume(token)  # copies: advancing one leaves the other (and the kept grammar) at the start
    assert torch.equal(second.allowed(), matcher.build_matcher(params, llm.tokenizer, vocab).allowed())


# ---- size bounds of a conversation ----------------------------------------------------------------------------------


def test_message_count_and_tool_size_bounds_are_400s_naming_the_bound(server: LiveServer) -> None:
    many = [{"role": "user", "content": "x"}] * (engine_requests.MAX_MESSAGES + 1)
    err = error_of(server.post(CHAT, json={"model": NAME, "messages": many, "max_tokens": 2}), 400)
    assert err["param"] == "messages" and f"at most {engine_requests.MAX_MESSAGES}" in err["message"]
    err = error_of(server.post("/tokenize", json={"model": NAME, "messages": many}), 400)  # the same bound
    assert err["param"] == "messages" and f"at most {engine_requests.MAX_MESSAGES}" in err["message"]
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                            for i in range(engine_requests.MAX_TOOL_BYTES // 100)}}
    tools = [{"type": "function", "function": {"name": "small", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "huge", "parameters": big}}]
    err = error_of(server.post(CHAT, json={"model": NAME, "messages": MSGS, "max_tokens": 2, "tools": tools}), 400)
    assert err["param"] == "tools" and "tools[1] ('huge')" in err["message"]
    assert f"at most {engine_requests.MAX_TOOL_BYTES} bytes" in err["message"]
    r = server.post(CHAT, json={"model": NAME, "messages": MSGS, "max_tokens": 2, "tools": tools[:1],
                                "tool_choice": "none"})  # within the bound (and no tool text in the tiny context)
    assert r.status_code == 200, r.text


# ---- the HTTP server's own connection bound --------------------------------------------------------------------------


def test_limit_concurrency_flag_reaches_uvicorn(monkeypatch: pytest.MonkeyPatch) -> None:
    from specdecode.cli import build_parser
    from specdecode.server import process

    seen = {}

    class FakeServer:
        def __init__(self, config: Any, state: Any, drain_timeout_s: float) -> None:
            seen["limit"] = config.limit_concurrency
            self.started = True

        def run(self) -> None:
            pass

    monkeypatch.setattr(process, "DrainingServer", FakeServer)
    app = type("App", (), {"state": type("S", (), {"server": None})()})()
    assert process.run_server(app, "127.0.0.1", 1, "info", 1.0, process.ProcessExit(), 7) == 0  # type: ignore
    assert seen["limit"] == 7
    parse = build_parser().parse_args
    assert parse(["serve", "--model", "m"]).limit_concurrency == 1024
    assert parse(["serve", "--model", "m", "--limit-concurrency", "0"]).limit_concurrency == 0
    with pytest.raises(SystemExit):
        parse(["serve", "--model", "m", "--limit-concurrency", "-1"])
