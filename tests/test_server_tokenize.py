"""vLLM's /tokenize, /detokenize and /version on a live server over a tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from server_helpers import API_KEY, LiveServer  # noqa: E402

import specdecode  # noqa: E402
from specdecode import LLM  # noqa: E402
from specdecode.server.app import build_app  # noqa: E402

NAME = "tiny"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    torch.set_num_threads(1)
    return LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", max_model_len=128)


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[LiveServer]:
    s = LiveServer(build_app(llm, max_num_seqs=1, served_model_name=NAME, api_key=API_KEY)).start()
    yield s
    s.stop()


def test_tokenize_prompt_and_round_trip(server: LiveServer, llm: LLM) -> None:
    r = server.post("/tokenize", json={"model": NAME, "prompt": "hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == llm.tokenizer.encode("hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 128
    assert body["token_strs"] == [llm.tokenizer.id_to_token(t) for t in body["tokens"]]
    r = server.post("/detokenize", json={"model": NAME, "tokens": body["tokens"]})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == llm.tokenizer.decode(body["tokens"], skip_special_tokens=False)


def test_tokenize_chat_is_what_a_chat_request_starts_from(server: LiveServer, llm: LLM) -> None:
    msgs = [{"role": "user", "content": "hi there"}]
    r = server.post("/tokenize", json={"messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == llm.chat_prompt_ids(msgs) and r.json()["token_strs"] is None
    chat = server.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]


def test_version(server: LiveServer) -> None:
    r = httpx.get(server.base_url + "/version", headers=server.headers)
    assert r.status_code == 200 and r.json() == {"version": specdecode.__version__}


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 10**7]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/tokenize", {"prompt": "hi", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"prompt": "hi", "surprise": 1}, "surprise"),
    ("/tokenize", {"model": NAME}, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
])
def test_bad_tokenizer_requests_are_400s_naming_the_field(server: LiveServer, path: str, body: dict,
                                                          param: str) -> None:
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
