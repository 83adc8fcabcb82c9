"""The server under faults: no request hangs, none waits forever.

An engine loop that fails outside its step fails every request in flight (a 500 body, or an error event then
`[DONE]`) and calls the exit hook; a step that hangs turns /health to 503; a request past its deadline answers
408 (a stream: an error event) and frees its row; SIGTERM drains a real server process, which then exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402
from server_helpers import API_KEY, LiveServer, free_port, sse_events  # noqa: E402

from specdecode import LLM  # noqa: E402
from specdecode.engine.core import Engine as BatchEngine  # noqa: E402
from specdecode.server.app import build_app  # noqa: E402

NAME = "tiny"
MAX_LEN = 512
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG = {"model": NAME, "prompt": "hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    torch.set_num_threads(1)
    return LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", max_model_len=MAX_LEN)


def slowed(engine: BatchEngine, seconds: float = 0.02) -> BatchEngine:
    """Each step sleeps first, so that a request lasts long enough to be caught in flight."""
    step = engine.step

    def slow_step() -> Any:
        time.sleep(seconds)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    return engine


def wait_for(check: Callable[[], bool], timeout: float = 5.0, what: str = "the condition") -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.02)


def idle(engine: BatchEngine) -> bool:
    """No row running or prefilling and nothing queued: every row and cache reference is free."""
    return not engine.running and engine.prefilling is None and not engine.waiting


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def stream_events(server: LiveServer, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, headers=server.headers,
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


@pytest.fixture
def serve(llm: LLM) -> Iterator[Callable[..., tuple[LiveServer, BatchEngine]]]:
    """Build and start a server over a fresh engine (`slow`: seconds each step sleeps); stopped after the test."""
    servers: list[LiveServer] = []

    def make(slow: float = 0.0, max_num_seqs: int = 2, **kw: Any) -> tuple[LiveServer, BatchEngine]:
        engine = llm.batch_engine(max_num_seqs=max_num_seqs, max_waiting=8)
        if slow:
            slowed(engine, slow)
        servers.append(LiveServer(build_app(llm, engine, served_model_name=NAME, api_key=API_KEY, **kw)).start())
        return servers[-1], engine

    yield make
    for s in servers:
        s.stop()


# ---- the engine loop dies outside its step ------------------------------------------------------------------


def test_loop_failure_fails_every_request_and_calls_the_exit_hook(serve: Callable) -> None:
    codes: list[int] = []
    server, engine = serve(slow=0.02, max_num_seqs=1, on_engine_death=codes.append)
    results: dict[str, Any] = {}

    def plain() -> None:
        results["plain"] = server.post(COMPLETIONS, json=LONG, timeout=30)

    def streamed() -> None:
        results["stream"] = stream_events(server, CHAT, {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 400, "ignore_eos": True})

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    wait_for(lambda: len(engine.running) + (engine.prefilling is not None) == 1 and len(engine.waiting) == 1,
             what="one request running and one waiting")

    def broken() -> None:
        raise RuntimeError("injected failure outside the step")

    server.app.state.engine._update_gauges = broken  # the loop's bookkeeping after a step
    started = time.monotonic()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads), "a request still waits 5 s after the engine died"
    assert time.monotonic() - started < 5
    err = assert_openai_error(results["plain"], 500)
    assert "injected failure" in err["message"] and err["type"] == "server_error"
    events = results["stream"]
    assert events[-1] == "[DONE]" and "injected failure" in events[-2]["error"]["message"], events[-3:]
    wait_for(lambda: codes == [1], what="the exit hook called with 1")
    health = httpx.get(server.base_url + "/health")
    assert health.status_code == 503 and "injected failure" in health.json()["status"]
    err = assert_openai_error(server.post(COMPLETIONS, json={**LONG, "max_tokens": 2}), 503)
    assert err["code"] == "engine_unavailable"


# ---- a step that hangs ------------------------------------------------------------------------------------


def test_a_hung_step_turns_health_to_503(serve: Callable) -> None:
    server, engine = serve(stall_timeout_s=0.3)
    release, entered = threading.Event(), threading.Event()
    step = engine.step

    def hanging_step() -> Any:
        entered.set()
        release.wait(30)
        return step()

    engine.step = hanging_step  # type: ignore[method-assign]
    result: dict[str, httpx.Response] = {}
    body = {**LONG, "max_tokens": 3}
    t = threading.Thread(target=lambda: result.setdefault("r", server.post(COMPLETIONS, json=body)))
    t.start()
    try:
        assert entered.wait(5)
        wait_for(lambda: httpx.get(server.base_url + "/health").status_code == 503, what="/health 503")
        assert "stalled" in httpx.get(server.base_url + "/health").json()["status"]
    finally:
        release.set()
    t.join(10)
    assert result["r"].status_code == 200
    assert httpx.get(server.base_url + "/health").status_code == 200  # steps run again


# ---- deadlines ----------------------------------------------------------------------------------------------


def test_requests_past_their_deadline_are_408_and_free_their_rows(serve: Callable) -> None:
    server, engine = serve(slow=0.02, request_timeout_s=1.0)
    started = time.monotonic()
    err = assert_openai_error(server.post(COMPLETIONS, json={**LONG, "timeout": 0.3}), 408)
    assert time.monotonic() - started < 1.0  # the request's own, shorter timeout
    assert err["code"] == "request_timeout" and err["type"] == "timeout_error" and "0.3 s" in err["message"]
    wait_for(lambda: idle(engine), what="the engine idle after the 408")

    err = assert_openai_error(server.post(CHAT, json={"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": 400, "ignore_eos": True}), 408)
    assert "1 s" in err["message"]  # the server's --request-timeout
    wait_for(lambda: idle(engine), what="the engine idle after the 408")

    events = stream_events(server, COMPLETIONS, {**LONG, "timeout": 0.3})
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout", events[-3:]
    assert any("choices" in e and e["choices"][0]["text"] for e in events[:-2])  # tokens came before the deadline
    wait_for(lambda: idle(engine), what="the engine idle after the stream's deadline")

    assert assert_openai_error(server.post(COMPLETIONS, json={**LONG, "timeout": 2}), 400)["param"] == "timeout"
    assert_openai_error(server.post(COMPLETIONS, json={**LONG, "timeout": 0}), 400)
    assert server.post(COMPLETIONS, json={**LONG, "max_tokens": 2, "timeout": 1}).status_code == 200
    m = server.metrics()
    assert m['specdecode_request_errors_total{code="408"}'] == 3
    assert m['specdecode_requests_finished_total{finish_reason="abort"}'] == 3
    assert m["specdecode_requests_running"] == 0 and m["specdecode_kv_cache_usage"] == 0


def test_timeout_flags_are_checked_before_the_model_loads() -> None:
    from specdecode.cli import build_parser
    from specdecode.serve_cli import run_serve_command

    args = build_parser().parse_args(["serve", "--model", "m"])
    assert (args.request_timeout, args.stall_timeout, args.drain_timeout) == (None, 60.0, 30.0)
    for flag, value in (("--request-timeout", "0"), ("--stall-timeout", "-1"), ("--drain-timeout", "nan")):
        with pytest.raises(ValueError, match=flag):
            run_serve_command(build_parser().parse_args(["serve", "--model", "m", flag, value]))


# ---- SIGTERM drains a server process ------------------------------------------------------------------------

SERVE = """
import sys, time
from specdecode.engine.core import Engine
step = Engine.step
def slow_step(self):  # each step sleeps, so that streams are still running when SIGTERM comes
    time.sleep(0.02)
    return step(self)
Engine.step = slow_step
from specdecode.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_drains_streams_then_exits_0(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-c", SERVE, "serve", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--device", "cpu",
           "--threads", "1", "--max-model-len", str(MAX_LEN), "--port", str(port), "--served-model-name", NAME,
           "--drain-timeout", "2", "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout=120, what="the server's start")
        client = httpx.Client(base_url=base, timeout=30)
        # A short stream finishes within the drain; a long one outlasts it and ends with an error event.
        opened = [client.send(client.build_request("POST", COMPLETIONS, json={**LONG, "max_tokens": n, "stream": True}),
                              stream=True) for n in (40, 400)]
        lines = [r.iter_lines() for r in opened]
        for it in lines:  # each stream has started
            assert next(line for line in it if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(base + "/health").status_code == 503, what="/health 503 while draining")
        assert httpx.get(base + "/health").json()["status"].startswith("draining")
        refused = httpx.post(base + COMPLETIONS, json={**LONG, "max_tokens": 2})
        assert assert_openai_error(refused, 503)["code"] == "server_shutting_down"
        short, long = (sse_events(it) for it in lines)
        assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length", short[-3:]
        assert not any("error" in e for e in short[:-1])
        assert long[-1] == "[DONE]" and "shutting down" in long[-2]["error"]["message"], long[-3:]
        for r in opened:
            r.close()
        client.close()
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


DYING = """
import sys
from specdecode.server.async_engine import AsyncEngine
update = AsyncEngine._update_gauges
def dying_update(self):  # the loop's bookkeeping fails once a request runs: outside the step
    if self.engine.has_work():
        raise RuntimeError("injected failure outside the step")
    return update(self)
AsyncEngine._update_gauges = dying_update
from specdecode.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_engine_fails_its_request_and_the_process_exits_non_zero(tiny_llama_dir: Path,
                                                                         tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-c", DYING, "serve", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--device", "cpu",
           "--threads", "1", "--max-model-len", str(MAX_LEN), "--port", str(port), "--served-model-name", NAME,
           "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout=120, what="the server's start")
        started = time.monotonic()
        r = httpx.post(base + COMPLETIONS, json={**LONG, "max_tokens": 8}, timeout=30)
        assert time.monotonic() - started < 5
        assert "injected failure" in assert_openai_error(r, 500)["message"]
        assert proc.wait(30) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
