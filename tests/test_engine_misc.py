"""Engine behaviour around the step loop: start-up validation, seeds, sampling with speculation,
chat, adaptive k with a useless drafter, and the metrics a request reports."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_helpers import copy_with_vocab_rows

from specdecode import LLM, SamplingParams
from specdecode.cost_model import CostModel
from specdecode.engine import llm as llm_module
from specdecode.engine import validation
from specdecode.engine.validation import IncompatibleDraftError, InsufficientMemoryError
from specdecode.model.load import read_config
from specdecode.proposers.base import Draft, ProposeRow

SMOL = "smollm2-135m-instruct"
PROMPT = "def add(a, b):\n    return a + b\n"
METRIC_KEYS = {
    "steps", "draft_tokens", "accepted_tokens", "mean_accepted_length", "acceptance_rate",
    "acceptance_by_position", "prompt_tokens", "output_tokens", "seconds", "tokens_per_second", "prefill_seconds",
}


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    """Overrides conftest's: one thread (tiny models; a second OpenMP thread only slows a loaded machine)."""
    torch.set_num_threads(1)


def fp32(model: Path | str, spec: dict[str, Any] | None = None, **kw: Any) -> LLM:
    return LLM(str(model), dtype="fp32", device="cpu", speculative_config=spec, **kw)


def draft_cfg(model: Path | str, k: int | str = 4, **kw: Any) -> dict[str, Any]:
    return {"method": "draft", "model": str(model), "num_speculative_tokens": k, "draft_dtype": "fp32", **kw}


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> LLM:
    return fp32(tiny_llama_dir)


@pytest.fixture(scope="module")
def spec_random(tiny_llama_dir: Path, tiny_llama_other_dir: Path) -> LLM:
    """Fixed k = 4 with a drafter that is right only by chance."""
    return fp32(tiny_llama_dir, draft_cfg(tiny_llama_other_dir, 4))


@pytest.fixture(scope="module")
def spec_same(tiny_llama_dir: Path) -> LLM:
    return fp32(tiny_llama_dir, draft_cfg(tiny_llama_dir, 4))


@pytest.fixture(scope="module")
def spec_same_auto(tiny_llama_dir: Path) -> LLM:
    """Adaptive k: the draft model may also propose bare prompt-lookup guesses."""
    return fp32(tiny_llama_dir, {"method": "draft", "model": str(tiny_llama_dir)})


@pytest.fixture(scope="module")
def spec_ngram(tiny_llama_dir: Path) -> LLM:
    return fp32(tiny_llama_dir, NGRAM)


# ---- start-up validation ----------------------------------------------------------------------


def copy_with_swapped_tokens(src: Path, dst: Path, a: int, b: int) -> Path:
    """Same weights, same vocabulary size, but ids a and b mean each other's strings."""
    shutil.copytree(src, dst)
    tok_file = dst / "tokenizer.json"
    data = json.loads(tok_file.read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    vocab[by_id[a]], vocab[by_id[b]] = b, a
    tok_file.write_text(json.dumps(data))
    return dst


def test_draft_with_a_different_tokenizer_is_refused_as_a_tree(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Another vocabulary drafts chains through text (tests/test_cross_vocab.py); a tree is refused, naming both
    models and the first differing ids, in both directions."""
    bad = copy_with_swapped_tokens(tiny_llama_dir, tmp_path / "swapped", 40, 41)
    with pytest.raises(IncompatibleDraftError) as info:
        fp32(tiny_llama_dir, draft_cfg(bad, draft_tree_width=2))
    msg = str(info.value)
    assert str(tiny_llama_dir) in msg and str(bad) in msg
    assert "first differing ids: 40: target" in msg and "chains only" in msg
    with pytest.raises(IncompatibleDraftError, match="first differing ids: 40: target"):
        fp32(bad, draft_cfg(tiny_llama_dir, draft_tree_width=0))
    assert fp32(tiny_llama_dir, draft_cfg(bad)).engine.proposer.name == "draft"  # a chain is fine


def test_draft_with_fewer_rows_than_token_ids_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Padding differences are accepted (tests/test_draft_vocab.py); a draft missing real ids is not."""
    cut = copy_with_vocab_rows(tiny_llama_dir, tmp_path / "cut", -20)
    with pytest.raises(IncompatibleDraftError) as info:
        fp32(tiny_llama_dir, draft_cfg(cut))
    msg = str(info.value)
    assert str(cut) in msg and str(tiny_llama_dir) in msg
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    assert str(vocab) in msg and str(vocab - 20) in msg and "more than padding" in msg


@pytest.mark.real
def test_real_and_tiny_vocabularies_refuse_trees_both_ways(tiny_llama_dir: Path) -> None:
    with pytest.raises(IncompatibleDraftError) as info:
        LLM(str(tiny_llama_dir), dtype="fp32", device="cpu",
            speculative_config={"model": SMOL, "draft_tree_width": 2})
    msg = str(info.value)
    assert SMOL in msg and str(tiny_llama_dir) in msg
    assert "49152" in msg and "first differing id" in msg
    with pytest.raises(IncompatibleDraftError) as info:
        LLM(SMOL, dtype="bf16", device="cpu", max_model_len=256,
            speculative_config={"model": str(tiny_llama_dir), "num_speculative_tokens": 2, "draft_tree_width": 2})
    msg = str(info.value)
    assert SMOL in msg and str(tiny_llama_dir) in msg and "first differing id" in msg


def _forbid_compute(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the target ran before the request was validated")

    monkeypatch.setattr(llm.engine, "_target_forward", boom)
    monkeypatch.setattr(llm.engine, "_prefill", boom)


def test_vllm_dict_prompts(plain: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = plain.tokenizer.encode(PROMPT)
    want = plain.generate(PROMPT, params)[0].token_ids
    outs = plain.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids}], params)
    assert [o.token_ids for o in outs] == [want, want]
    assert plain.generate({"prompt": PROMPT}, params)[0].token_ids == want
    for bad in ({"prompt": PROMPT, "prompt_token_ids": ids}, {"text": PROMPT}, {"prompt_token_ids": PROMPT}):
        with pytest.raises(ValueError, match="prompt_token_ids"):
            plain.generate(bad, params)


def test_prompt_plus_max_tokens_over_context_is_refused_before_compute(
    spec_random: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_compute(spec_random, monkeypatch)
    ctx = spec_random.max_model_len
    with pytest.raises(ValueError, match=f"context length {ctx}"):
        spec_random.generate(PROMPT, SamplingParams(max_tokens=ctx))
    # One bad prompt in a batch: nothing at all is computed, not even the good ones before it.
    with pytest.raises(ValueError, match="exceeds the context"):
        spec_random.generate([PROMPT, [5] * (ctx - 3)], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="exceeds the context"):
        next(iter(spec_random.stream([5] * ctx, SamplingParams(max_tokens=1))))
    with pytest.raises(ValueError, match="empty prompt"):
        spec_random.generate([[]], SamplingParams(max_tokens=1))  # type: ignore[list-item]


def test_prompt_that_fills_the_context_exactly_is_fine(tiny_llama_dir: Path) -> None:
    llm = fp32(tiny_llama_dir, NGRAM, max_model_len=32)
    out = llm.generate([7] * 24, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


@pytest.mark.parametrize("max_model_len", [2, 4, 9, 12])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_short_context_with_auto_k(
    tiny_llama_dir: Path, tiny_llama_other_dir: Path, plain: LLM, method: str, max_model_len: int
) -> None:
    """Start-up cost measurement (auto k) must fit a context shorter than k_max; output stays exact."""
    cfg = draft_cfg(tiny_llama_other_dir, "auto") if method == "draft" else {"method": "ngram"}
    llm = fp32(tiny_llama_dir, cfg, max_model_len=max_model_len)
    assert llm.cost is not None and llm.engine.cost is llm.cost
    prompt = plain.tokenizer.encode(PROMPT)[: max_model_len // 2]
    params = SamplingParams(max_tokens=max_model_len - len(prompt), temperature=0.0, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == plain.generate(prompt, params)[0].token_ids
    assert len(prompt) + len(out.token_ids) == max_model_len


def test_memory_check_refuses_before_loading(
    tiny_llama_dir: Path, tiny_llama_other_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validation, "available_bytes", lambda device: 10 * 2**20)

    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were loaded before the memory check")

    monkeypatch.setattr(llm_module, "load_resolved", no_load)
    with pytest.raises(InsufficientMemoryError, match="GiB") as info:
        fp32(tiny_llama_dir, draft_cfg(tiny_llama_other_dir))
    assert "target" in str(info.value) and "draft" in str(info.value)
    with pytest.raises(MemoryError):
        fp32(tiny_llama_dir)


@pytest.mark.parametrize("tied", [True, False])
def test_memory_estimate_counts_a_re_laid_out_copy_of_a_tied_output_matrix(
    tiny_llama_dir: Path, tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On AVX2 and AMX CPUs the bf16 kernel keeps its own copy of every linear's weights, a tied output matrix
    included."""
    cfg = dataclasses.replace(read_config(tiny_llama_dir), tie_word_embeddings=tied)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    sizes = {}
    for packs in (True, False):
        monkeypatch.setattr(validation, "bf16_copies_weights", lambda packs=packs: packs)
        sizes[packs] = (validation.estimate_bytes(cfg, bf16, 64, device=cpu),
                        validation.estimate_bytes(cfg, torch.float32, 64, device=cpu),
                        validation.estimate_bytes(cfg, bf16, 64, device=torch.device("cuda")))
    extra = cfg.vocab_size * cfg.hidden_size * 2 if tied else 0
    assert sizes[True][0] - sizes[False][0] == extra
    assert sizes[True][1:] == sizes[False][1:]


# ---- sampling -----------------------------------------------------------------------------------


def sampled(seed: int | None, max_tokens: int = 24, **kw: Any) -> SamplingParams:
    base: dict[str, Any] = {"temperature": 1.5, "max_tokens": max_tokens, "seed": seed, "ignore_eos": True}
    base.update(kw)
    return SamplingParams(**base)


@pytest.mark.parametrize("which", ["plain", "spec_random", "spec_same", "spec_ngram", "spec_same_auto"])
def test_seeded_sampling_is_reproducible(which: str, request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(which)
    repeats = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps"  # lookup guesses
    a = llm.generate([PROMPT, "The quick", repeats], sampled(seed=1234))
    b = llm.generate([PROMPT, "The quick", repeats], sampled(seed=1234))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    # Other seeds give other samples (at temperature 1.5 the tiny model is far from deterministic).
    others = {tuple(llm.generate(PROMPT, sampled(seed=s))[0].token_ids) for s in range(3)}
    assert len(others | {tuple(a[0].token_ids)}) > 1
    # No seed in the request: the LLM's default seed, also reproducible.
    c = llm.generate(PROMPT, sampled(seed=None))[0]
    d = llm.generate(PROMPT, sampled(seed=None))[0]
    assert c.token_ids == d.token_ids


SAMPLING_CASES = [
    {"temperature": 0.8, "top_k": 20},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.7, "min_p": 0.1},
    {"temperature": 1.0, "repetition_penalty": 1.3},
    {"temperature": 1.2, "top_k": 50, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.2,
     "presence_penalty": 0.5, "frequency_penalty": 0.3},
]


@pytest.mark.parametrize("which", ["spec_random", "spec_same", "spec_ngram", "spec_same_auto"])
@pytest.mark.parametrize("case", SAMPLING_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_sampling_with_speculation(which: str, case: dict[str, Any], request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(which)
    out = llm.generate([PROMPT, "The quick brown fox"], SamplingParams(max_tokens=20, seed=3, ignore_eos=True, **case))
    vocab = llm.target.config.vocab_size
    for o in out:
        assert len(o.token_ids) == 20 and o.finish_reason == "length"
        assert all(0 <= t < vocab for t in o.token_ids)
        m = o.metrics
        assert m["output_tokens"] == 20 and m["steps"] + m["accepted_tokens"] == 20
        assert 0 <= m["accepted_tokens"] <= m["draft_tokens"]
    if which == "spec_same":
        # Draft distribution == target distribution (up to fp32 rounding): practically everything is accepted.
        assert sum(o.metrics["accepted_tokens"] for o in out) >= 0.9 * sum(o.metrics["draft_tokens"] for o in out)
    # Without ignore_eos the output may end early, never late.
    short = llm.generate(PROMPT, SamplingParams(max_tokens=7, seed=5, **case))[0]
    assert 1 <= len(short.token_ids) <= 7


@pytest.mark.parametrize("which", ["spec_random", "spec_same", "spec_ngram"])
def test_greedy_with_penalties_matches_plain(which: str, plain: LLM, request: pytest.FixtureRequest) -> None:
    """Penalties see each draft token before it as output: greedy + penalties stays exact."""
    llm: LLM = request.getfixturevalue(which)
    params = SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7,
                            presence_penalty=0.4, ignore_eos=True)
    for prompt in (PROMPT, "The quick brown fox jumps over the lazy dog. The quick"):
        assert llm.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids


# ---- chat ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["plain", "spec_same"])
def test_chat(which: str, plain: LLM, request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(which)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = llm.chat(msgs, params)
    assert len(out) == 1
    ids = llm.tokenizer.apply_chat_template(msgs)
    assert out[0].prompt_token_ids == ids
    assert ids[0] == llm.tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    assert out[0].token_ids == plain.generate(ids, params)[0].token_ids
    # A list of conversations gives one output each, in order.
    two = llm.chat([msgs, [{"role": "user", "content": "hi"}]], params)
    assert len(two) == 2 and two[0].token_ids == out[0].token_ids
    with pytest.raises(ValueError, match="empty"):
        llm.chat([], params)


# ---- adaptive k ---------------------------------------------------------------------------------


class CountingRows:
    """Wraps a batch proposer and records, per proposal, how many tokens it drafted."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.drafted: list[tuple[int, int]] = []  # (output tokens before the step, tokens drafted)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        drafts = self.inner.propose(rows)
        self.drafted += [(len(r.seq.token_ids) - r.seq.prompt_len, len(d)) for r, d in zip(rows, drafts, strict=True)]
        return drafts


@pytest.fixture(scope="module")
def spec_auto_random(tiny_llama_dir: Path, tiny_llama_other_dir: Path) -> LLM:
    return fp32(tiny_llama_dir, draft_cfg(tiny_llama_other_dir, "auto"))


# A draft model step costs 20% of a target forward; verifying 9 tokens costs 1.2 forwards.
KNOWN_COST = CostModel.from_points({1: 0.010, 9: 0.012}, 9, draft_step_seconds=0.002)


def test_adaptive_k_stops_drafting_with_a_useless_drafter(
    spec_auto_random: LLM, plain: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = spec_auto_random.engine
    assert engine.fixed_k is None and engine.cost is not None  # "auto" measured the cost at start-up
    measured, original = engine.cost, engine.proposer
    counting = CountingRows(spec_auto_random.new_proposer())
    engine.set_proposer(counting, KNOWN_COST)  # type: ignore[arg-type]  # deterministic, whatever the machine's load
    n = 200
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    try:
        out = spec_auto_random.generate(PROMPT, params)[0]
    finally:
        engine.set_proposer(original, measured)
    assert out.token_ids == plain.generate(PROMPT, params)[0].token_ids
    m = out.metrics
    assert m["acceptance_rate"] <= 0.2
    assert m["steps"] >= 0.9 * n
    assert m["draft_tokens"] <= 0.15 * m["steps"]
    # After warm-up (the first 40 tokens) only occasional 1-token probes remain.
    late = [d for pos, d in counting.drafted if pos >= 40]
    assert len(late) <= 0.05 * (n - 40)
    assert all(d <= 1 for d in late)


def test_adaptive_k_drafts_long_with_a_perfect_drafter(spec_same: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = spec_same.engine
    measured = engine.cost
    monkeypatch.setattr(engine, "fixed_k", None)
    monkeypatch.setattr(engine, "k_max", 8)
    engine.cost = KNOWN_COST
    spec_same.lookup.store.clear()  # earlier tests' answers (sampled ones too) would be guessed from
    try:
        out = spec_same.generate(PROMPT, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0]
    finally:
        engine.cost = measured
    assert out.metrics["acceptance_rate"] == 1.0
    assert out.metrics["mean_accepted_length"] > 4


def test_adaptive_k_with_measured_cost_stays_exact(spec_auto_random: LLM, plain: LLM) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    out = spec_auto_random.generate(PROMPT, params)[0]
    assert out.token_ids == plain.generate(PROMPT, params)[0].token_ids
    assert out.metrics["draft_tokens"] < 40 * 8


# ---- metrics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["plain", "spec_random", "spec_same", "spec_ngram"])
def test_metrics_keys_and_values(which: str, request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(which)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    m = out.metrics
    assert METRIC_KEYS <= set(m)
    json.dumps(m)  # JSON-ready
    assert m["prompt_tokens"] == len(llm.tokenizer.encode(PROMPT)) == len(out.prompt_token_ids)
    assert m["output_tokens"] == 16 == len(out.token_ids)
    assert m["seconds"] > 0 and m["tokens_per_second"] == pytest.approx(16 / m["seconds"])
    assert 0 < m["prefill_seconds"] <= m["seconds"]
    assert m["mean_accepted_length"] == pytest.approx(16 / m["steps"])
    assert 0.0 <= m["acceptance_rate"] <= 1.0
    assert all(0.0 <= a <= 1.0 for a in m["acceptance_by_position"])
    if which == "plain":
        assert m["steps"] == 16 and m["draft_tokens"] == 0 and m["acceptance_by_position"] == []
    if which == "spec_same":
        assert m["acceptance_rate"] == 1.0 and m["acceptance_by_position"] == [1.0] * 4
    assert out.outputs[0].token_ids == out.token_ids and out.outputs[0].text == out.text


def test_request_timing_excludes_the_wait_for_earlier_prompts(plain: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """generate() validates every prompt first, then runs them as a batch of up to max_num_seqs rows; each
    request's seconds / tokens_per_second must measure its own generation, not the wait for a free row."""
    engine = plain.engine
    real = engine._prefill

    def slow_prefill(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)  # stand-in for a long earlier request
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_prefill", slow_prefill)
    monkeypatch.setattr(engine, "max_num_seqs", 1)  # one row: each request waits for the one before it
    outs = plain.generate([PROMPT, PROMPT, PROMPT], SamplingParams(max_tokens=4, temperature=0.0))
    for o in outs:
        assert o.metrics["seconds"] < 0.5, o.metrics


def test_batch_engine_refuses_rows_that_do_not_fit(tiny_llama_dir, monkeypatch) -> None:
    from specdecode import LLM
    from specdecode.engine import validation
    from specdecode.engine.validation import InsufficientMemoryError

    llm = LLM(str(tiny_llama_dir), dtype="fp32", max_model_len=256)
    # Each row of the tiny model's cache is 256+64 slots x 2 KB; pretend only 1 MB is free.
    monkeypatch.setattr(validation, "available_bytes", lambda device: 1 << 20)
    with pytest.raises(InsufficientMemoryError, match="target KV cache"):
        llm.batch_engine(max_num_seqs=64)
    monkeypatch.setattr(validation, "available_bytes", lambda device: 1 << 34)
    assert llm.batch_engine(max_num_seqs=2).max_num_seqs == 2


def test_batch_cap_counts_the_draft_catch_up(tiny_llama_dir) -> None:
    """A row whose drafter must first catch up on a long context only drafts if that pays."""
    from specdecode import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram"})
    engine = llm.batch_engine(max_num_seqs=2)
    # A flat forward; catch-up 10 ms per token
    engine.cost = CostModel.from_points({1: 0.1, 64: 0.1}, 64, catch_up_token_seconds=0.01)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for text in ("def add(a, b):", "The quick brown fox"):
        engine.add(llm.new_sequence(text, params))
    engine.step()
    tokens = {"n": 0}
    catch_up = dataclasses.replace(engine.proposer.capabilities, catch_up=True, lookup=False)  # as a draft model
    engine.proposer.capabilities = catch_up
    engine.proposer.catch_up_tokens = lambda key, view: tokens["n"]
    assert max(engine._schedule().ks) > 0
    tokens["n"] = 10_000  # e.g. a draft model's prefill of a huge prompt
    assert engine._schedule().ks == [0, 0]
    # A catch-up that pays when spread over the next steps does not during a dip in the load (the batch
    # held 4 rows a moment ago: the rows about to join would cap drafting again).
    tokens["n"] = 50
    engine._recent_rows.clear()
    assert max(engine._schedule().ks) > 0
    engine._recent_rows.append(4)
    assert engine._schedule().ks == [0, 0]


def test_a_lookup_row_is_priced_by_the_nodes_its_lookup_found(tiny_llama_dir) -> None:
    """A lookup drafts in the schedule: a row whose lookup finds nothing does not widen the batch's forward, a row
    that finds 2 nodes is priced at 2, and the step proposes each draft once."""
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram"})
    engine = llm.batch_engine(max_num_seqs=3)
    engine.cost = CostModel.from_points({1: 0.1, 64: 0.1}, 64)  # a flat forward: every row would draft k_max
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for text in ("def add(a, b):", "The quick brown fox", "x = 1"):
        engine.add(llm.new_sequence(text, params))
    engine.step()
    found = {engine.running[0].key: [5, 6], engine.running[1].key: []}
    calls: list[list[int]] = []

    def propose(asks: list[ProposeRow]) -> list[Draft]:
        calls.append([a.k for a in asks])
        return [Draft(found.get(a.key, [7, 8, 9, 10])[: a.k]) for a in asks]

    engine.proposer.propose = propose
    lengths = engine._schedule()
    assert lengths.ks[:2] == [2, 0] and lengths.ks[2] > 2
    rows = engine._propose(lengths)
    assert [r.tokens[1:] for r in rows] == [[5, 6], [], [7, 8, 9, 10][: lengths.ks[2]]]
    assert len(calls) == 1  # drafted in the schedule only


def test_the_prompt_catch_up_is_spread_over_the_rest_of_the_request(tiny_llama_dir) -> None:
    """A draft model's first catch-up (its prefill of the prompt) is paid once for the whole answer: a lone
    request drafts when that pays over its remaining tokens, and a short one does not."""
    from specdecode import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram"})
    engine = llm.batch_engine(max_num_seqs=1)
    # The costs of the 1.5B GGUF target and 0.5B draft on a 2-core CPU: a draft step about a third of a
    # target step, and a catch-up of ~6 ms per prompt token.
    engine.cost = CostModel.from_points({1: 0.052, 3: 0.056, 9: 0.085}, 9, draft_step_seconds=0.016,
                                        catch_up_token_seconds=0.006)
    engine.proposer.capabilities = dataclasses.replace(engine.proposer.capabilities, catch_up=True, lookup=False)
    engine.proposer.catch_up_tokens = lambda key, view: 60  # a chat prompt the draft has not seen
    for max_tokens, drafts in ((400, True), (12, False)):
        engine.add(llm.new_sequence("def add(a, b):", SamplingParams(max_tokens=max_tokens, temperature=0)))
        engine.step()
        assert (max(engine._schedule().ks) > 0) is drafts
        engine.abort(engine.running[0].seq.request_id)


def test_draft_proposer_reports_its_catch_up(tiny_llama_dir) -> None:
    from specdecode import LLM

    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "draft", "model": str(tiny_llama_dir)})
    engine = llm.batch_engine(max_num_seqs=2)
    assert engine.proposer is not None and engine.proposer.capabilities.catch_up
    assert engine.cost is not None and engine.cost.catch_up_token_seconds > 0  # measured at start-up


def test_a_probe_that_needs_a_catch_up_is_capped_like_any_k() -> None:
    """A free probe (n-gram, a head) always runs; a probe whose draft model must first catch up on the context runs
    only where the batch's cost model says it pays."""
    from specdecode.engine.adaptive import AdaptiveK
    from specdecode.engine.schedule import PreferredDraft, choose_lengths

    cost = CostModel.from_points({1: 0.1, 16: 0.1}, 16)
    probing = AdaptiveK(cost)
    probing.tracker.update(4, 0)  # a drafter that keeps missing
    probing._probing = True  # noqa: SLF001 - the state next_k leaves after a run of k = 0
    plain = AdaptiveK(fixed_k=0)
    assert choose_lengths([PreferredDraft(1, probing), PreferredDraft(0, plain)], cost, 1, 4).ks == [1, 0]
    assert choose_lengths([PreferredDraft(1, probing, 2.0), PreferredDraft(0, plain)], cost, 1, 4).ks == [0, 0]


def test_a_probe_in_a_batch_is_capped_where_widening_the_forward_does_not_pay() -> None:
    """A lone row's probe runs whatever the cost (it keeps the row's estimate alive); in a batch the probe pads
    every row to two tokens, so it runs only where the batch's cost model says that pays."""
    from specdecode.engine.adaptive import AdaptiveK
    from specdecode.engine.schedule import PreferredDraft, choose_lengths

    cost = CostModel.from_points({1: 0.05, 8: 0.08, 16: 0.14}, 16)  # many rows: wider forwards cost more

    def probing() -> AdaptiveK:
        policy = AdaptiveK(cost)
        policy.tracker.update(4, 0)  # a drafter that keeps missing
        policy._probing = True  # noqa: SLF001 - the state next_k leaves after a run of k = 0
        return policy

    assert choose_lengths([PreferredDraft(1, probing())], cost, 1, 4).ks == [1]
    plain = [PreferredDraft(0, AdaptiveK(fixed_k=0)) for _ in range(7)]
    assert choose_lengths([PreferredDraft(1, probing()), *plain], cost, 1, 4).ks == [0] * 8


def test_a_guess_proposed_alone_is_priced_without_the_drafters_steps() -> None:
    """A row wants 3 tokens, each kept at the rate 0.6 given the ones before. From its draft model, whose steps cost
    as much as a target forward, they cost more than they bring, so the cap turns the row off; as a lookup guess
    proposed alone (no drafter forward, no catch-up) they pay, and the row keeps them."""
    from specdecode.engine.adaptive import AdaptiveK
    from specdecode.engine.schedule import PreferredDraft, choose_lengths

    cost = CostModel.from_points({1: 0.05, 16: 0.06}, 16, draft_step_seconds=0.05)
    assert AdaptiveK(cost).tracker.alpha(0) == 0.6
    assert choose_lengths([PreferredDraft(3, AdaptiveK(cost))], cost, 1, 4).ks == [0]
    assert choose_lengths([PreferredDraft(3, AdaptiveK(cost), guess_rate=0.6)], cost, 1, 4).ks == [3]
