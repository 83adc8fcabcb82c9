"""The request surface beyond plain sampling, with the official `openai` client on loopback, under speculation:
logprobs, `n`, logit_bias, min_tokens, seed, and a 400 naming every field the server does not implement.

Three servers over the tiny fp32 Llama: prompt lookup from one token on (k=3; most drafts are rejected), and a
draft model that is the target itself (k=3) as a chain and as a tree (width 2: one branch is accepted, its
sibling not). Greedy answers and their logprobs must equal plain decoding's (`LLM` without
speculation); a sampled answer's logprobs must equal the processed target distribution at its tokens, computed
by one forward over the prompt and the answer.
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

from server_helpers import API_KEY, LiveServer  # noqa: E402
from stat_helpers import block_output_counts  # noqa: E402

from specdecode import LLM, SamplingParams  # noqa: E402
from specdecode.sampling import LOGPROB_FLOOR, processed_logprobs  # noqa: E402
from specdecode.server.app import build_app  # noqa: E402
from specdecode.server.logprobs_format import TokenText  # noqa: E402

MAX_LEN = 256
NAME = "tiny-llama"
TOL = 0.0
"""Logprobs are computed from the very logits that verify, and every model here is batch-invariant (each token
of a forward computed as if alone), so they have the same bits with speculation on or off."""
OFF = {"speculative": {"num_speculative_tokens": 0}}


def _llm(model: Path, spec: dict[str, Any] | None = None) -> LLM:
    torch.set_num_threads(1)
    return LLM(str(model), dtype="fp32", device="cpu", speculative_config=spec, max_model_len=MAX_LEN,
               batch_invariant=True)


@pytest.fixture(scope="module")
def ref(tiny_llama_dir: Path) -> LLM:
    return _llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def ngram_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    s = LiveServer(build_app(_llm(tiny_llama_dir, spec), max_num_seqs=4, served_model_name=NAME,
                             api_key=API_KEY)).start()
    yield s
    s.stop()


def _draft_server(model: Path, **spec: Any) -> LiveServer:
    llm = _llm(model, {"method": "draft", "model": str(model), "num_speculative_tokens": 3, **spec})
    engine = llm.batch_engine(max_num_seqs=4, max_waiting=16)
    engine.cost = None  # keep the fixed k=3 (the cost model rightly finds a target-sized draft never pays)
    return LiveServer(build_app(llm, engine, served_model_name=NAME, api_key=API_KEY)).start()


@pytest.fixture(scope="module")
def chain_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    s = _draft_server(tiny_llama_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tree_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    s = _draft_server(tiny_llama_dir, draft_tree_width=2)
    s.tree = True  # type: ignore[attr-defined]  # its seeded samples may differ between runs (docs/serving.md)
    yield s
    s.stop()


@pytest.fixture(params=["ngram", "chain", "tree"])
def server(request: pytest.FixtureRequest) -> LiveServer:
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(params=["ngram", "chain"])
def chain_or_ngram(request: pytest.FixtureRequest) -> LiveServer:
    return request.getfixturevalue(f"{request.param}_server")


def msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def chat(server: LiveServer, content: str, **kw: Any) -> Any:
    extra = kw.pop("extra_body", {})
    return server.openai().chat.completions.create(model=NAME, messages=msgs(content), extra_body=extra, **kw)


def token_ids(ref: LLM, content: list[Any]) -> list[int]:
    """The ids of a chat answer's tokens, from each token's bytes (unique per id in this vocabulary)."""
    text = TokenText(ref.tokenizer)
    by_bytes = {tuple(text(i)[1]): i for i in range(ref.target.config.vocab_size)}
    return [by_bytes[tuple(c.bytes)] for c in content]


def check_top(content: list[Any], k: int, greedy: bool) -> None:
    """top_logprobs: k entries, sorted descending; the chosen token's logprob is its entry's when listed."""
    for c in content:
        lps = [t.logprob for t in c.top_logprobs]
        assert len(lps) == k and lps == sorted(lps, reverse=True)
        listed = {tuple(t.bytes): t.logprob for t in c.top_logprobs}  # token strings may collide ("\ufffd")
        if tuple(c.bytes) in listed:
            assert listed[tuple(c.bytes)] == c.logprob
        if greedy:
            assert c.top_logprobs[0].bytes == c.bytes
        assert c.logprob <= 0.0


def forced_logits(ref: LLM, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The target's logits [m, V] before each of the m output tokens, computed as plain decoding computes
    them: the prompt's forward, then one forward per token."""
    model = ref.target.model
    cache = model.new_cache(1, len(prompt) + len(out) + 1)
    hidden = model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0), cache.rows(0, 1))
    cache.set_length(0, len(prompt))
    rows = [model.compute_logits(hidden[0, -1:])]
    for pos, tok in enumerate(out[:-1], start=len(prompt)):
        hidden = model(torch.tensor([[tok]]), torch.tensor([[pos]]), cache.rows(0, 1))
        cache.set_length(0, pos + 1)
        rows.append(model.compute_logits(hidden[0, -1:]))
    return torch.cat(rows)


# ---- logprobs -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["def zeros", "The quick brown"])
def test_greedy_logprobs_equal_plain_decoding(server: LiveServer, ref: LLM, content: str) -> None:
    want = ref.chat(msgs(content), SamplingParams(max_tokens=24, temperature=0, logprobs=4))[0]
    assert want.logprobs is not None and len(want.logprobs) == len(want.token_ids)
    on = chat(server, content, max_tokens=24, temperature=0, logprobs=True, top_logprobs=4)
    off = chat(server, content, max_tokens=24, temperature=0, logprobs=True, top_logprobs=4, extra_body=OFF)
    assert on.usage.speculative["draft_tokens"] > 0 and off.usage.speculative["draft_tokens"] == 0
    text = TokenText(ref.tokenizer)
    for answer in (on, off):
        content_lp = answer.choices[0].logprobs.content
        assert answer.choices[0].message.content == want.text
        assert [c.token for c in content_lp] == [text(t)[0] for t in want.token_ids]
        check_top(content_lp, 4, greedy=True)
        for c, w in zip(content_lp, want.logprobs, strict=True):
            assert abs(c.logprob - w.logprob) <= TOL
            assert [t.token for t in c.top_logprobs] == [text(t)[0] for t, _ in w.top]
            assert all(abs(t.logprob - lp) <= TOL for t, (_, lp) in zip(c.top_logprobs, w.top, strict=True))
    chunks = list(chat(server, content, max_tokens=24, temperature=0, logprobs=True, top_logprobs=4, stream=True))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.bytes for c in streamed] == [c.bytes for c in on.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([w.logprob for w in want.logprobs], abs=TOL)
    # Completions: the legacy shape, and the same numbers streamed.
    client = server.openai()
    got = client.completions.create(model=NAME, prompt="for i in", max_tokens=16, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == got.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(top[tok] == v == max(top.values()) and 1 <= len(top) <= 3  # greedy: the chosen token is top-1
               for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    chunks = list(client.completions.create(model=NAME, prompt="for i in", max_tokens=16, temperature=0,
                                            logprobs=3, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=TOL)
    offsets = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_sampled_logprobs_are_the_processed_target_distribution(server: LiveServer, ref: LLM) -> None:
    params = dict(temperature=0.8, top_p=0.9, frequency_penalty=0.5, seed=11, max_tokens=24)
    got = chat(server, "hello there", logprobs=True, top_logprobs=5, **params)
    assert got.usage.speculative["draft_tokens"] > 0
    content = got.choices[0].logprobs.content
    check_top(content, 5, greedy=False)
    out = token_ids(ref, content)
    prompt = ref.chat_prompt_ids(msgs("hello there"))
    logits = forced_logits(ref, prompt, out)
    counts = block_output_counts(torch.zeros(logits.shape[-1], dtype=torch.long), torch.tensor(out[:-1]))  # [m, V]
    sp = SamplingParams(**{k: v for k, v in params.items() if k != "seed"})
    want = processed_logprobs(logits, sp, counts).clamp_min(LOGPROB_FLOOR)  # [m, V]
    for j, (c, tok) in enumerate(zip(content, out, strict=True)):
        assert abs(c.logprob - float(want[j, tok])) <= TOL, j
        assert c.logprob > LOGPROB_FLOOR  # a sampled token was allowed by top-p
        top = torch.topk(want[j], 5).values.tolist()
        got_top = [t.logprob for t in c.top_logprobs]
        assert got_top == pytest.approx(top, abs=TOL), (j, got_top, top)


def test_python_api_logprobs_with_speculation(tiny_llama_dir: Path, ref: LLM) -> None:
    spec = _llm(tiny_llama_dir, {"method": "draft", "model": str(tiny_llama_dir), "num_speculative_tokens": 3})
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2)
    want, got = ref.generate("import numpy", params)[0], spec.generate("import numpy", params)[0]
    assert got.metrics["accepted_tokens"] > 0 and got.token_ids == want.token_ids
    assert got.outputs[0].logprobs is not None and len(got.outputs[0].logprobs) == len(got.token_ids)
    for g, w in zip(got.logprobs or [], want.logprobs or [], strict=True):
        assert g.token_id == w.token_id == g.top[0][0] and abs(g.logprob - w.logprob) <= TOL


# ---- n ------------------------------------------------------------------------------------------------------


def test_n_choices_share_the_prompt(server: LiveServer, ref: LLM) -> None:
    # Greedy: every choice is plain decoding's answer (the copied prefill is the prompt's).
    want = ref.chat(msgs("add print"), SamplingParams(max_tokens=20, temperature=0))[0]
    model = server.app.state.server.llm.target.model
    forward, prefills = model.forward, []
    last = len(ref.chat_prompt_ids(msgs("add print"))) - 1

    def counting(ids: torch.Tensor, positions: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        # A prefill ends at the prompt's last token (a pooled prefix may start it past position 0).
        prefills.append(int(positions[0, -1] == last))
        return forward(ids, positions, *args, **kw)

    model.forward = counting
    try:
        got = chat(server, "add print", n=3, max_tokens=20, temperature=0)
    finally:
        del model.forward
    assert sum(prefills) == 1  # the prompt ran once for the three choices
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert all(c.message.content == want.text for c in got.choices)
    assert got.usage.prompt_tokens == len(ref.chat_prompt_ids(msgs("add print")))
    assert got.usage.completion_tokens == 3 * len(want.token_ids)
    # Sampled: distinct choices, reproducible with the seed, streamed as the same choices.
    exact = not getattr(server, "tree", False)  # a dynamic tree's seeded sample may change between runs
    kw: dict[str, Any] = dict(n=3, max_tokens=12, temperature=1.0, seed=5, logprobs=True,
                              extra_body={"ignore_eos": True})
    a, b = chat(server, "hello", **kw), chat(server, "hello", **kw)
    texts = [c.message.content for c in a.choices]
    assert len(set(texts)) > 1 and (texts == [c.message.content for c in b.choices] or not exact)
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices) == 36
    chunks = list(chat(server, "hello", stream=True, stream_options={"include_usage": True}, **kw))
    streamed = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts or not exact
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 36
    assert chunks[-1].usage.prompt_tokens == a.usage.prompt_tokens
    done = server.openai().completions.create(model=NAME, prompt="x = ", n=2, best_of=2, max_tokens=5, seed=1)
    assert len(done.choices) == 2 and done.usage.completion_tokens <= 10


# ---- logit_bias, min_tokens, max_completion_tokens, seed -----------------------------------------------------


def test_logit_bias_forces_and_forbids(server: LiveServer, ref: LLM) -> None:
    plain = ref.chat(msgs("def zeros"), SamplingParams(max_tokens=16, temperature=0))[0]
    banned = max(set(plain.token_ids), key=plain.token_ids.count)
    bias = {banned: -100.0}
    want = ref.chat(msgs("def zeros"), SamplingParams(max_tokens=16, temperature=0, logit_bias=bias))[0]
    assert banned not in want.token_ids
    got = chat(server, "def zeros", max_tokens=16, temperature=0, logit_bias={str(banned): -100})
    assert got.choices[0].message.content == want.text
    forced = chat(server, "def zeros", max_tokens=8, temperature=0.7, seed=3, logprobs=True,
                  logit_bias={"60": 100}, extra_body={"ignore_eos": True})
    assert token_ids(ref, forced.choices[0].logprobs.content) == [60] * 8


def test_min_tokens_holds_back_eos(server: LiveServer, ref: LLM) -> None:
    eos = ref.tokenizer.eos_token_id
    kw: dict[str, Any] = dict(max_tokens=12, temperature=0, logit_bias={str(eos): 100})
    early = chat(server, "hello", **kw)
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    late = chat(server, "hello", extra_body={"min_tokens": 5}, logprobs=True, **kw)
    assert late.usage.completion_tokens == 6 and late.choices[0].finish_reason == "stop"
    want = ref.chat(msgs("hello"), SamplingParams(max_tokens=12, temperature=0, logit_bias={eos: 100}, min_tokens=5))[0]
    assert want.token_ids[-1] == eos and len(want.token_ids) == 6
    assert late.choices[0].message.content == want.text
    assert token_ids(ref, late.choices[0].logprobs.content) == want.token_ids
    beyond = chat(server, "hello", max_tokens=4, extra_body={"min_tokens": 2, "stop_token_ids": [10**6]})
    assert beyond.usage.completion_tokens >= 2  # a stop id outside the vocabulary has nothing to mask
    capped = chat(server, "hello", max_completion_tokens=3, max_tokens=50, temperature=0,
                  extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"


def test_seed_reproduces_sampled_output_with_speculation(chain_or_ngram: LiveServer) -> None:
    # Chains only: a dynamic tree's shape follows the drafter's measured timings, so a seeded answer through a
    # tree is a correct sample but not always the same one (docs/serving.md).
    server = chain_or_ngram
    kw: dict[str, Any] = dict(max_tokens=24, temperature=1.0, extra_body={"ignore_eos": True, "top_k": 40})
    a, b = chat(server, "The quick", seed=42, **kw), chat(server, "The quick", seed=42, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.speculative["draft_tokens"] > 0
    others = {chat(server, "The quick", seed=s, **kw).choices[0].message.content for s in (1, 2)}
    assert others != {a.choices[0].message.content}


# ---- every field the server does not implement is a 400 naming it ---------------------------------------------

CHAT_REFUSED: list[tuple[str, Any]] = [
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("prompt_cache_key", "k"),
    ("safety_identifier", "s"),
    ("echo", True),
    ("suffix", "x"),
    ("best_of", 2),
    ("no_such_field", 1),
]
COMPLETION_REFUSED: list[tuple[str, Any]] = [
    ("echo", True),
    ("suffix", "!"),
    ("best_of", 3),
    ("messages", [{"role": "user", "content": "hi"}]),
    ("top_logprobs", 2),
    ("max_completion_tokens", 4),
    ("no_such_field", 1),
]


@pytest.mark.parametrize("case", CHAT_REFUSED, ids=[c[0] for c in CHAT_REFUSED])
def test_chat_refuses_unimplemented_fields(ngram_server: LiveServer, case: tuple[str, Any]) -> None:
    field, value = case
    r = ngram_server.post("/v1/chat/completions", json={"model": NAME, "messages": msgs("hi"), "max_tokens": 2,
                                                         field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


@pytest.mark.parametrize("case", COMPLETION_REFUSED, ids=[c[0] for c in COMPLETION_REFUSED])
def test_completions_refuse_unimplemented_fields(ngram_server: LiveServer, case: tuple[str, Any]) -> None:
    field, value = case
    r = ngram_server.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]
