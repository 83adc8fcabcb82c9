"""Load and disconnects: 16 concurrent streaming clients over a continuous batch with ragged speculation.

The server runs the tiny fp32 Llama with a *useless* drafter (different random weights, fixed k=3), so
acceptance varies per sequence and per step; requests also override k (0, 1, server default) and
have different lengths, so they join and leave the batch at different steps, and half of them wait
in the queue first (8 rows, 16 clients). Every answer must equal its single-request greedy
reference, with zero errors, and the server's memory must stay flat across two rounds.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

import httpx  # noqa: E402
import psutil  # noqa: E402
from server_helpers import API_KEY, LiveServer  # noqa: E402

from specdecode import LLM, SamplingParams  # noqa: E402
from specdecode.server.app import build_app  # noqa: E402

NAME = "tiny"
MAX_LEN = 512
CLIENTS = 16
WORDS = ["def", "add", "fox", "dog", "print", "import", "np", "zeros", "range", "lazy", "quick", "return"]


def _llm(model: Path, spec: dict[str, Any] | None = None) -> LLM:
    torch.set_num_threads(1)
    return LLM(str(model), dtype="fp32", device="cpu", speculative_config=spec, max_model_len=MAX_LEN)


class _Delay:
    """Wraps BatchEngine.step with an adjustable sleep (to make a stream last long enough to cancel it)."""

    def __init__(self, engine: Any) -> None:
        self.step = engine.step
        self.seconds = 0.0
        engine.step = self

    def __call__(self) -> Any:
        if self.seconds:
            time.sleep(self.seconds)
        return self.step()


@pytest.fixture(scope="module")
def ref(tiny_llama_dir: Path) -> LLM:
    return _llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tiny_llama_other_dir: Path) -> Iterator[tuple[LiveServer, _Delay]]:
    llm = _llm(tiny_llama_dir, {"method": "draft", "model": str(tiny_llama_other_dir), "num_speculative_tokens": 3})
    engine = llm.batch_engine(max_num_seqs=8, max_waiting=32)
    engine.cost = None  # keep the fixed k=3 even though this drafter never pays: we want rejections
    delay = _Delay(engine)
    server = LiveServer(build_app(llm, engine, served_model_name=NAME, api_key=API_KEY)).start()
    yield server, delay
    server.stop()


def _requests(ref: LLM) -> list[dict[str, Any]]:
    """16 requests: chat and completions, different lengths, k overrides 0 / 1 / server default."""
    out = []
    for i in range(CLIENTS):
        text = f"{WORDS[i % len(WORDS)]} {WORDS[(i * 5 + 3) % len(WORDS)]} {i}"
        max_tokens = 16 + (i * 7) % 48
        spec = [None, {"num_speculative_tokens": 0}, {"num_speculative_tokens": 1}][i % 3]
        chat = i % 2 == 0
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        want = (ref.chat([{"role": "user", "content": text}], params) if chat else ref.generate(text, params))[0]
        out.append({"text": text, "max_tokens": max_tokens, "spec": spec, "chat": chat, "want": want})
    return out


def _stream_one(server: LiveServer, req: dict[str, Any]) -> dict[str, Any]:
    client = server.openai()
    extra = {"speculative": req["spec"]} if req["spec"] else {}
    common = dict(model=NAME, max_tokens=req["max_tokens"], temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra)
    if req["chat"]:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": req["text"]}], **common))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        chunks = list(client.completions.create(prompt=req["text"], **common))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    client.close()
    return {"text": text, "finish": finish, "usage": chunks[-1].usage}


def _round(server: LiveServer, reqs: list[dict[str, Any]]) -> None:
    start = threading.Barrier(CLIENTS)

    def run(req: dict[str, Any]) -> dict[str, Any]:
        start.wait(30)
        return _stream_one(server, req)

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(run, reqs))  # re-raises any client error
    for req, got in zip(reqs, results, strict=True):
        want = req["want"]
        assert got["text"] == want.text, req["text"]
        assert got["finish"] == [want.finish_reason]
        assert got["usage"].completion_tokens == len(want.token_ids)
        drafted = got["usage"].speculative["draft_tokens"]
        if req["spec"] == {"num_speculative_tokens": 0}:
            assert drafted == 0


def _rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def test_sixteen_concurrent_streams_equal_their_references(served: tuple[LiveServer, _Delay], ref: LLM) -> None:
    server, _ = served
    reqs = _requests(ref)
    _round(server, reqs)
    m1 = server.metrics()
    rss1 = _rss_mb()
    _round(server, reqs)
    rss2 = _rss_mb()
    m2 = server.metrics()
    assert rss2 - rss1 < 40, f"RSS grew {rss2 - rss1:.1f} MB in the second round"
    assert m2["specdecode_requests_running"] == 0 and m2["specdecode_requests_waiting"] == 0
    assert m2["specdecode_kv_cache_usage"] == 0
    assert not any(k.startswith("specdecode_request_errors_total") for k in m2)
    finished = sum(v for k, v in m2.items() if k.startswith("specdecode_requests_finished_total"))
    assert finished == 2 * CLIENTS
    tokens = sum(len(r["want"].token_ids) for r in reqs)
    assert m2["specdecode_generation_tokens_total"] == 2 * tokens
    assert m2["specdecode_generation_tokens_total"] - m1["specdecode_generation_tokens_total"] == tokens
    # A useless drafter: drafts were verified and some of them rejected, yet every answer is exact.
    assert 0 < m2["specdecode_spec_decode_num_accepted_tokens_total"] < m2[
        "specdecode_spec_decode_num_draft_tokens_total"]


def _wait_idle(server: LiveServer, timeout: float = 2.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["specdecode_requests_running"] == 0 and m["specdecode_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy after {timeout}s: running {m['specdecode_requests_running']}, "
                                 f"waiting {m['specdecode_requests_waiting']}")
        time.sleep(0.02)


def test_disconnect_mid_stream_frees_the_slot(served: tuple[LiveServer, _Delay]) -> None:
    server, delay = served
    before = server.metrics()
    aborted = 'specdecode_requests_finished_total{finish_reason="abort"}'
    delay.seconds = 0.01  # ~400 steps would take several seconds
    try:
        body = {"model": NAME, "prompt": "def add", "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = [line for line, _ in zip(lines, range(8), strict=False) if line.startswith("data: ")]
                assert len(got) >= 3
                assert server.metrics()["specdecode_requests_running"] == 1
            # leaving the block closes the connection mid-stream
        t0 = time.monotonic()
        after = _wait_idle(server, 2.0)
        assert time.monotonic() - t0 < 2.0
        assert after["specdecode_kv_cache_usage"] == 0
        assert after[aborted] - before.get(aborted, 0) == 1
        made = after["specdecode_generation_tokens_total"] - before["specdecode_generation_tokens_total"]
        assert made < 200, f"{made} tokens generated for a stream cancelled after a few chunks"

        # A non-streaming client that gives up (its connection drops) is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/v1/completions", headers=server.headers, timeout=0.5,
                       json={**body, "stream": False})
        after2 = _wait_idle(server, 2.0)
        assert after2[aborted] - after[aborted] == 1
    finally:
        delay.seconds = 0.0
    r = server.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
