"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP on loopback.

Servers over the tiny fp32 Llama: prompt lookup (adaptive k), a draft model that is the target itself (fixed
k=3, so every draft is accepted and each step emits blocks of 4 tokens), suffix decoding, and a draft with another
tokenizer. Every greedy
answer must equal `LLM.generate` of a plain fp32 LLM alone, streamed or not, with or without speculation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

import httpx  # noqa: E402
from server_helpers import API_KEY, LiveServer, sse_events  # noqa: E402

from specdecode import LLM, SamplingParams  # noqa: E402
from specdecode.server.app import build_app  # noqa: E402

MAX_LEN = 512
PROMPTS = ["def add(a, b):", "The quick brown", "for i in range(10):", "import numpy as np"]
CHATS = ["def zeros", "add print", "hello there"]
NAME = "tiny-llama"


def _llm(model: Path, spec: dict[str, Any] | None = None) -> LLM:
    torch.set_num_threads(1)
    return LLM(str(model), dtype="fp32", device="cpu", speculative_config=spec, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def ref(tiny_llama_dir: Path) -> LLM:
    return _llm(tiny_llama_dir)


def _serve(llm: LLM, **kw: Any) -> LiveServer:
    app = build_app(llm, max_num_seqs=4, max_waiting=16, served_model_name=NAME, api_key=API_KEY, **kw)
    return LiveServer(app).start()


@pytest.fixture(scope="module")
def ngram_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    server = _serve(_llm(tiny_llama_dir, {"method": "ngram"}))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def draft_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    spec = {"method": "draft", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    llm = _llm(tiny_llama_dir, spec)
    engine = llm.batch_engine(max_num_seqs=4, max_waiting=16)
    # The batch-wide cost cap rightly finds that a draft as big as its target never pays and drafts nothing;
    # without the measured cost the fixed k=3 is used as is, which is what these tests need.
    engine.cost = None
    server = _serve(llm, engine=engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def suffix_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    server = _serve(_llm(tiny_llama_dir, {"method": "suffix", "suffix_cache_tokens": 4096}))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cross_server(tiny_llama_dir: Path, tiny_sentencepiece_dir: Path) -> Iterator[LiveServer]:
    """A draft with another tokenizer (SentencePiece-style, its own chat template)."""
    spec = {"method": "draft", "model": str(tiny_sentencepiece_dir), "num_speculative_tokens": 3}
    llm = _llm(tiny_llama_dir, spec)
    engine = llm.batch_engine(max_num_seqs=4, max_waiting=16)
    engine.cost = None  # a fixed k of 3, drafted whatever the cost (as draft_server)
    server = _serve(llm, engine=engine)
    yield server
    server.stop()


@pytest.fixture(params=["ngram", "draft", "suffix", "cross"])
def server(request: pytest.FixtureRequest) -> LiveServer:
    return request.getfixturevalue(f"{request.param}_server")


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def chat_messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---- basics -----------------------------------------------------------------------------------------------


def test_health_models_and_auth(draft_server: LiveServer) -> None:
    base = draft_server.base_url
    assert httpx.get(base + "/health").status_code == 200  # no key needed
    models = draft_server.openai().models.list()
    assert [m.id for m in models.data] == [NAME]
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(base + path)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        r = httpx.get(base + path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    r = draft_server.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2},
                          headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    from openai import AuthenticationError, OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    assert draft_server.openai().models.retrieve(NAME).id == NAME
    r = httpx.get(base + "/v1/models/other", headers=draft_server.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_serve_command_line() -> None:
    from specdecode.cli import build_parser
    from specdecode.serve_cli import _is_loopback

    args = build_parser().parse_args(["serve", "--model", "m", "--method", "ngram", "--api-key", "k"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.api_key == "k" and args.method == "ngram"
    assert args.func.__name__ == "run_serve_command"
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("example.com")


# ---- completions ------------------------------------------------------------------------------------------


def test_suffix_server_drafts_from_earlier_answers_and_reports_its_store(suffix_server: LiveServer,
                                                                         ref: LLM) -> None:
    want = ref.generate(PROMPTS[2], greedy(40, ignore_eos=True))[0]
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    first, again = (suffix_server.post("/v1/completions", json=body).json() for _ in range(2))
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == want.text
    assert again["usage"]["speculative"]["mean_accepted_length"] > first["usage"]["speculative"][
        "mean_accepted_length"]
    m = suffix_server.metrics()
    assert 0 < m["specdecode_suffix_cache_tokens"] <= m["specdecode_suffix_cache_max_tokens"] == 4096
    assert m["specdecode_suffix_cache_bytes"] > 0



def test_completions_match_reference(server: LiveServer, ref: LLM) -> None:
    client = server.openai()
    for prompt in PROMPTS:
        want = ref.generate(prompt, greedy(40))[0]
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0)
        choice = got.choices[0]
        assert choice.text == want.text, prompt
        assert choice.finish_reason == want.finish_reason
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.prompt_tokens == len(ref.tokenizer.encode(prompt))
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        spec = got.usage.speculative
        assert spec["steps"] >= 1 and spec["mean_accepted_length"] >= 1.0


def test_completion_token_id_prompt_and_stream(server: LiveServer, ref: LLM) -> None:
    ids = ref.tokenizer.encode(PROMPTS[0])
    want = ref.generate(ids, greedy(30))[0]
    client = server.openai()
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=30, temperature=0)
    assert got.choices[0].text == want.text
    stream = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == want.text and finals == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


# ---- chat -------------------------------------------------------------------------------------------------


def test_chat_matches_reference_streamed_and_not(server: LiveServer, ref: LLM) -> None:
    client = server.openai()
    for content in CHATS:
        want = ref.chat(chat_messages(content), greedy(48))[0]
        got = client.chat.completions.create(model=NAME, messages=chat_messages(content), max_tokens=48,
                                             temperature=0)
        assert got.choices[0].message.content == want.text
        assert got.choices[0].message.role == "assistant"
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.completion_tokens == len(want.token_ids)

        chunks = list(client.chat.completions.create(
            model=NAME, messages=chat_messages(content), max_tokens=48, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.text
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [want.finish_reason]
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage.completion_tokens == len(want.token_ids)
        assert usage.prompt_tokens == len(ref.chat_prompt_ids(chat_messages(content)))
        assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_has_spec_extension_in_final_chunk(draft_server: LiveServer) -> None:
    r = draft_server.post("/v1/chat/completions", json={
        "model": NAME, "messages": chat_messages("hi"), "max_tokens": 12, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text.splitlines())
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert "usage" not in final and final["speculative"]["steps"] >= 1


# ---- speculation is real, per request, and visible ---------------------------------------------------------


def test_draft_speculation_accepts_and_can_be_turned_off(draft_server: LiveServer, ref: LLM) -> None:
    client = draft_server.openai()
    want = ref.generate(PROMPTS[1], greedy(40, ignore_eos=True))[0]
    before = draft_server.metrics()
    on = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                   extra_body={"ignore_eos": True})
    spec = on.usage.speculative
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] == spec["draft_tokens"]  # draft == target
    assert spec["mean_accepted_length"] > 2.0 and spec["steps"] < 40
    off = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True, "speculative": {"num_speculative_tokens": 0}})
    assert off.usage.speculative["draft_tokens"] == 0 and off.usage.speculative["steps"] == 40
    k1 = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                   extra_body={"ignore_eos": True, "speculative": {"num_speculative_tokens": 1}})
    assert len(k1.usage.speculative["acceptance_by_position"]) == 1
    assert on.choices[0].text == off.choices[0].text == k1.choices[0].text == want.text
    after = draft_server.metrics()
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew["specdecode_spec_decode_num_accepted_tokens_total"] == spec["accepted_tokens"] + \
        k1.usage.speculative["accepted_tokens"]
    assert grew["specdecode_spec_decode_num_draft_tokens_total"] == spec["draft_tokens"] + \
        k1.usage.speculative["draft_tokens"]
    assert grew['specdecode_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert grew["specdecode_generation_tokens_total"] == 120
    assert grew["specdecode_prompt_tokens_total"] == 3 * on.usage.prompt_tokens
    assert grew['specdecode_requests_finished_total{finish_reason="length"}'] == 3
    assert after["specdecode_requests_running"] == 0 and after["specdecode_kv_cache_usage"] == 0
    assert grew["specdecode_step_seconds_count"] > 0


# ---- stop strings, EOS and stop tokens inside an accepted block ----------------------------------------------


def _stop_string_inside(text: str) -> str:
    """A 3-character printable piece of `text` starting well inside it (so it spans token boundaries)."""
    for i in range(6, len(text) - 3):
        piece = text[i : i + 3]
        if piece.isprintable() and piece.isascii() and text.find(piece) == i and piece.strip() == piece:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_spanning_an_accepted_block(draft_server: LiveServer, ref: LLM) -> None:
    client = draft_server.openai()
    for prompt in PROMPTS[:3]:
        full = ref.generate(prompt, greedy(60, ignore_eos=True))[0].text
        stop = _stop_string_inside(full)
        want = ref.generate(prompt, greedy(60, ignore_eos=True, stop=(stop,)))[0]
        assert want.finish_reason == "stop" and want.text == full[: full.find(stop)]
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=60, temperature=0, stop=[stop, "\x00"],
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
        assert got.usage.completion_tokens == len(want.token_ids)
        deltas = [c.choices[0].text for c in client.completions.create(
            model=NAME, prompt=prompt, max_tokens=60, temperature=0, stop=stop, stream=True,
            extra_body={"ignore_eos": True}) if c.choices]
        assert "".join(deltas) == want.text
        assert all(stop not in d for d in deltas)


def test_eos_and_stop_token_mid_block(draft_server: LiveServer, ref: LLM) -> None:
    client = draft_server.openai()
    candidates = ["def print", "def import", "print add", "import def"]
    eos_prompts = [p for p in candidates if ref.generate(p, greedy(120))[0].finish_reason == "stop"]
    assert eos_prompts, "the tiny model should end at least one of these prompts with EOS"
    for prompt in eos_prompts[:2]:
        want = ref.generate(prompt, greedy(120))[0]
        assert want.token_ids[-1] == ref.tokenizer.eos_token_id
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=120, temperature=0)
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
        assert got.usage.completion_tokens == len(want.token_ids)  # EOS counted, nothing after it
        assert got.usage.speculative["draft_tokens"] > 0
    # An extra stop token in the middle of a block of 4: generation ends right there.
    full = ref.generate(PROMPTS[0], greedy(40, ignore_eos=True))[0]
    pos = next(i for i in range(6, 40) if i % 4 == 2 and full.token_ids.index(full.token_ids[i]) == i)
    stop_id = full.token_ids[pos]
    want = ref.generate(PROMPTS[0], greedy(40, ignore_eos=True, stop_token_ids=(stop_id,)))[0]
    assert len(want.token_ids) == pos + 1
    chunks = list(client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == pos + 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_default_max_tokens_and_sampling_params(ngram_server: LiveServer, ref: LLM) -> None:
    client = ngram_server.openai()
    got = client.completions.create(model=NAME, prompt=PROMPTS[2], temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 256  # min(256, remaining context) when max_tokens is omitted
    long_prompt = ref.tokenizer.encode("x")[-1:] * (MAX_LEN - 5)
    got = client.completions.create(model=NAME, prompt=long_prompt, temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 5 and got.choices[0].finish_reason == "length"
    # Seeded sampling with every knob is reproducible and equals the engine alone.
    kw = dict(temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3)
    extra = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    a = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, extra_body=extra, **kw)
    b = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, extra_body=extra, **kw)
    assert a.choices[0].text == b.choices[0].text
    off = {**extra, "speculative": {"num_speculative_tokens": 0}}
    c = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, extra_body=off, **kw)
    want = ref.generate(PROMPTS[0], SamplingParams(max_tokens=24, **kw, **extra))[0]
    assert c.choices[0].text == want.text


# ---- multi-byte characters with a real tokenizer -------------------------------------------------------------


@pytest.mark.real
def test_multibyte_text_streams_intact() -> None:
    smol = LLM("smollm2-135m-instruct", dtype="fp32", device="cpu", max_model_len=256)
    server = LiveServer(build_app(smol, max_num_seqs=2, max_waiting=4, api_key=API_KEY)).start()
    try:
        messages = [{"role": "user", "content": "Écris une phrase en français avec des accents: é, è, à, ç."}]
        want = smol.chat(messages, greedy(24))[0]
        assert any(ord(ch) > 127 for ch in want.text) and "\ufffd" not in want.text
        assert want.text == smol.tokenizer.decode(want.token_ids)
        chunks = list(server.openai().chat.completions.create(
            model="smollm2-135m-instruct", messages=messages, max_tokens=24, temperature=0, stream=True))
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(deltas) == want.text
        assert all("\ufffd" not in d for d in deltas)
    finally:
        server.stop()
