"""The server's prefix cache: a second chat over the same system prompt reports cached prompt tokens in
`usage.prompt_tokens_details` and in /metrics (n choices: the shared prefill's), and answers as an LLM without the
cache does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from server_helpers import API_KEY, LiveServer  # noqa: E402

from specdecode import LLM, SamplingParams  # noqa: E402
from specdecode.server.app import build_app  # noqa: E402

NAME = "tiny-llama"
SYSTEM = "You write code. " * 12


def test_second_request_reads_the_shared_prompt_from_the_cache(tiny_llama_dir: Path) -> None:
    torch.set_num_threads(1)
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config={"method": "ngram"},
              max_model_len=512)
    plain = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", max_model_len=512, enable_prefix_caching=False)
    server = LiveServer(build_app(llm, max_num_seqs=2, max_waiting=8, served_model_name=NAME,
                                  api_key=API_KEY)).start()
    try:
        client = server.openai()
        usages, texts = [], []
        for question in ("def add", "print hello"):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
            usages.append(out.usage)
            texts.append(out.choices[0].message.content)
            want = plain.generate(plain.chat_prompt_ids(messages), SamplingParams(max_tokens=8, temperature=0))
            assert texts[-1] == want[0].text
        assert usages[0].prompt_tokens_details.cached_tokens == 0
        cached = usages[1].prompt_tokens_details.cached_tokens
        assert 32 <= cached < usages[1].prompt_tokens
        metrics = server.metrics()
        assert metrics["specdecode_prefix_cache_hits_total"] == cached
        assert metrics["specdecode_prefix_cache_queries_total"] == usages[0].prompt_tokens + usages[1].prompt_tokens
        assert 0 < metrics["specdecode_prefix_cache_hit_rate"] < 1
        assert 0 < metrics["specdecode_prefix_cache_usage"] < 1
        # n choices (one per row): one prefill reads the pool, the sibling copies it; usage reports the shared
        # prefill's cached tokens.
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "sum a list"}]
        out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, n=2)
        want = plain.generate(plain.chat_prompt_ids(messages), SamplingParams(max_tokens=8, temperature=0))
        assert [c.message.content for c in out.choices] == [want[0].text] * 2
        assert out.usage.prompt_tokens_details.cached_tokens == cached
        queried = server.metrics()["specdecode_prefix_cache_queries_total"]
        assert queried == usages[0].prompt_tokens + usages[1].prompt_tokens + out.usage.prompt_tokens
    finally:
        server.stop()


def test_cache_salt_keeps_tenants_apart(tiny_llama_dir: Path) -> None:
    """Requests share cached blocks only within one `cache_salt` (or without one); a bad salt is a 400 naming it."""
    torch.set_num_threads(1)
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", max_model_len=512)
    server = LiveServer(build_app(llm, max_num_seqs=2, max_waiting=8, served_model_name=NAME,
                                  api_key=API_KEY)).start()
    try:
        client = server.openai()

        def cached(question: str, salt: str | None = None) -> int:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            extra = {} if salt is None else {"cache_salt": salt}
            out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0,
                                                 extra_body=extra)
            return out.usage.prompt_tokens_details.cached_tokens

        assert cached("def add", "tenant-1") == 0
        assert cached("def sub", "tenant-2") == 0  # another tenant's salt shares nothing
        assert cached("def mul") == 0  # nor does the shared namespace
        assert cached("def div", "tenant-1") >= 32  # the same salt does
        assert cached("def mod") >= 32
        out = client.completions.create(model=NAME, prompt=SYSTEM, max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": "tenant-3"})
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        for bad in ("", 7, "x" * 1025, "\ud800"):  # the last one a lone surrogate escape
            body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_salt": bad}
            r = server.post("/v1/chat/completions", content=json.dumps(body),
                            headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    finally:
        server.stop()
