"""Stop rules honoured inside an accepted block.

With the target itself as draft model and k = 8, one step emits up to 9 tokens at once; a
stop (EOS, a stop token id, a stop string, max_tokens) that falls inside that block must end
the output exactly where plain decoding ends it: identical token ids, text and finish reason,
nothing after the stop. Random tiny models produce no EOS by themselves, so the stop is a
token / text that plain decoding produces at a known position (~5); the real EOS is checked
on SmolLM2 (marker `real`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from specdecode import LLM, RequestOutput, SamplingParams

K = 8
FULL_TOKENS = 30
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    """Overrides conftest's: one thread (tiny models; a second OpenMP thread only slows a loaded machine)."""
    torch.set_num_threads(1)


@dataclass
class Pair:
    plain: LLM
    spec: LLM
    full: RequestOutput
    """Plain greedy output of PROMPT with ignore_eos and no stops."""

    def both(self, params: SamplingParams, prompt: str | list[int] = PROMPT) -> tuple[RequestOutput, RequestOutput]:
        a = self.plain.generate(prompt, params)[0]
        b = self.spec.generate(prompt, params)[0]
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
        return a, b


def params(**kw: object) -> SamplingParams:
    base: dict[str, object] = {"max_tokens": FULL_TOKENS, "temperature": 0.0}
    base.update(kw)
    return SamplingParams(**base)  # type: ignore[arg-type]


def same_model_llm(path: Path) -> LLM:
    return LLM(str(path), dtype="fp32", device="cpu", speculative_config={
        "method": "draft", "model": str(path), "num_speculative_tokens": K, "draft_dtype": "fp32"})


@pytest.fixture(scope="module")
def pair(tiny_llama_dir: Path) -> Iterator[Pair]:
    plain = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu")
    spec = same_model_llm(tiny_llama_dir)
    full = plain.generate(PROMPT, params(ignore_eos=True))[0]
    # The same-model drafter must really deliver blocks of K + 1 tokens, or the tests below test nothing.
    full_spec = spec.generate(PROMPT, params(ignore_eos=True))[0]
    assert full_spec.token_ids == full.token_ids
    assert full_spec.metrics["acceptance_rate"] == 1.0
    yield Pair(plain, spec, full)


def first_new_token_position(ids: list[int], around: int = 5) -> int:
    """A position >= around whose token does not occur earlier, so a stop on it fires exactly there."""
    for pos in range(around, len(ids)):
        if ids[pos] not in ids[:pos]:
            return pos
    raise AssertionError(f"no fresh token after position {around} in {ids}")


def assert_stopped_inside_block(out: RequestOutput) -> None:
    """The step that hit the stop had verified more tokens than were kept."""
    m = out.metrics
    assert m["output_tokens"] == len(out.token_ids)
    # Without truncation, output tokens = prefill token + (accepted + 1) per verify step.
    assert m["accepted_tokens"] + m["steps"] > m["output_tokens"]


def test_stop_token_id_inside_block(pair: Pair) -> None:
    ids = pair.full.token_ids
    pos = first_new_token_position(ids)
    assert pos < K + 1  # inside the first verified block
    plain, spec = pair.both(params(stop_token_ids=[ids[pos]]))
    assert spec.token_ids == ids[: pos + 1]  # the stop token is the last one, nothing after
    assert spec.finish_reason == "stop"
    assert pair.full.text.startswith(spec.text)
    assert_stopped_inside_block(spec)


def test_eos_inside_block(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = pair.full.token_ids
    pos = first_new_token_position(ids, around=4)
    # Pretend this model's EOS is the token plain decoding emits at `pos` (both LLMs read it per request).
    for llm in (pair.plain, pair.spec):
        monkeypatch.setattr(llm.tokenizer, "eos_token_id", ids[pos])
    plain, spec = pair.both(params())
    assert spec.token_ids == ids[: pos + 1]
    assert spec.finish_reason == "stop"
    assert_stopped_inside_block(spec)
    # ignore_eos runs through it.
    plain, spec = pair.both(params(ignore_eos=True))
    assert spec.token_ids == ids and spec.finish_reason == "length"


def _pieces(pair: Pair) -> list[str | None]:
    """Text each reference token adds, or None where it is not cleanly separable (partial UTF-8)."""
    tok = pair.plain.tokenizer
    ids = pair.full.token_ids
    out: list[str | None] = []
    for pos in range(len(ids)):
        before, upto = tok.decode(ids[:pos]), tok.decode(ids[: pos + 1])
        piece = upto[len(before) :] if upto.startswith(before) else ""
        out.append(piece if piece.strip() and "\ufffd" not in piece else None)
    return out


def test_stop_string_single_token_inside_block(pair: Pair) -> None:
    text = pair.full.text
    pieces = _pieces(pair)
    # The first token from position 3 whose text is clean and new (its first occurrence is right there).
    pos, piece = next((i, p) for i, p in enumerate(pieces) if i >= 3 and p and p not in "".join(
        q or "" for q in pieces[:i]) and p not in pair.plain.tokenizer.decode(pair.full.token_ids[:i]))
    assert pos < K + 1
    plain, spec = pair.both(params(stop=[piece]))
    assert spec.finish_reason == "stop"
    assert spec.text == text[: text.find(piece)]  # cut before the stop string
    assert piece not in spec.text
    assert spec.token_ids == pair.full.token_ids[: pos + 1]
    assert_stopped_inside_block(spec)


def test_stop_string_across_tokens_inside_block(pair: Pair) -> None:
    text = pair.full.text
    pieces = _pieces(pair)
    # A stop string that starts in one token's text and ends in the next token's.
    pos = next(i for i in range(3, len(pieces) - 1) if pieces[i] and pieces[i + 1])
    stop = pieces[pos][-1] + pieces[pos + 1][:2]  # type: ignore[index]
    cut = text.find(stop)
    plain, spec = pair.both(params(stop=[stop, "never-produced-xyz"]))
    assert spec.finish_reason == "stop"
    assert spec.text == text[:cut]
    assert stop not in spec.text
    assert len(spec.token_ids) <= pos + 2
    assert spec.token_ids == pair.full.token_ids[: len(spec.token_ids)]
    assert_stopped_inside_block(spec)
    # Streaming the same request never shows part of the stop string and ends with the same text.
    deltas = [d for d, _ in pair.spec.stream(PROMPT, params(stop=[stop]))]
    assert "".join(deltas) == spec.text


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 8, 9, 10, 11, 17, 18, 19])
def test_max_tokens_inside_block(pair: Pair, max_tokens: int) -> None:
    plain, spec = pair.both(params(max_tokens=max_tokens, ignore_eos=True))
    assert len(spec.token_ids) == max_tokens
    assert spec.token_ids == pair.full.token_ids[:max_tokens]
    assert spec.finish_reason == "length"
    assert spec.metrics["output_tokens"] == max_tokens
    assert spec.metrics["steps"] + spec.metrics["accepted_tokens"] == max_tokens


def test_stop_token_with_ngram_proposer(tiny_llama_dir: Path, pair: Pair) -> None:
    """The n-gram proposer's blocks obey the same rules (a prompt that repeats itself gets drafts)."""
    ngram = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config={
        "method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    ids = pair.full.token_ids
    prompt = pair.plain.tokenizer.encode(PROMPT) + ids[:12] + pair.plain.tokenizer.encode(PROMPT)
    ref = pair.plain.generate(prompt, params(ignore_eos=True))[0].token_ids
    pos = first_new_token_position(ref, around=3)
    for p in (params(stop_token_ids=[ref[pos]]), params(max_tokens=pos + 1, ignore_eos=True)):
        a = pair.plain.generate(prompt, p)[0]
        b = ngram.generate(prompt, p)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert b.token_ids == ref[: pos + 1]


# ---- real EOS on SmolLM2 -------------------------------------------------------------------------


@pytest.mark.real
def test_real_eos_inside_block() -> None:
    """SmolLM2 answers a short chat request and ends with its own EOS inside a speculative block."""
    msgs = [{"role": "user", "content": "Reply with one short sentence: hello."}]
    p = SamplingParams(max_tokens=40, temperature=0.0)
    plain = LLM("smollm2-135m-instruct", dtype="fp32", device="cpu", max_model_len=256)
    a = plain.chat(msgs, p)[0]
    eos = plain.tokenizer.eos_token_id
    assert a.finish_reason == "stop" and a.token_ids[-1] == eos, "the reference must end with EOS"
    spec = LLM("smollm2-135m-instruct", dtype="fp32", device="cpu", max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": K})
    from specdecode.proposers.draft_rows import DraftModelRows

    spec.engine.set_proposer(DraftModelRows(spec.target.model, spec.max_model_len))  # same weights
    b = spec.chat(msgs, p)[0]
    assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert b.token_ids.count(eos) == 1
    assert b.metrics["acceptance_rate"] == 1.0
    if (len(a.token_ids) - 1) % (K + 1):  # the EOS did not land exactly on a block's end
        assert_stopped_inside_block(b)
