"""The processors and reports behind the request surface: logit_bias, min_tokens, processed logprobs (pure), and
choices of one prompt sharing its prefill in the engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.logprobs import mask_early_stops, token_logprobs
from specdecode.heads.persist import new_head, save_head
from specdecode.model.load import load_model
from specdecode.proposers.base import Draft, ProposeRow
from specdecode.sampling import LOGPROB_FLOOR, logits_to_probs, processed_logprobs

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])  # [1, 5]


def test_logit_bias_shifts_raw_logits_before_everything() -> None:
    forced = logits_to_probs(LOGITS, SamplingParams(temperature=0, logit_bias={3: 100}))
    assert forced.argmax().item() == 3
    banned = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, logit_bias={0: -100}))
    assert banned[0, 0] < 1e-30 and math.isclose(banned.sum().item(), 1.0, rel_tol=1e-6)
    assert SamplingParams(logit_bias={4: 1.5, 1: -2}).logit_bias == ((1, -2.0), (4, 1.5))
    for bad in ({1: 101}, {-1: 0}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_min_tokens_masks_stops_only_before_the_minimum() -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=(1,))
    logits = LOGITS.expand(4, -1)  # nodes at depths 0..3 of a chain
    out = mask_early_stops(logits, params, eos_token_id=0, num_output=1, depth=torch.arange(4))
    # Node d gives output token 1 + d + 1: tokens 2 and 3 may not stop, tokens 4 and 5 may.
    assert torch.isinf(out[:2, [0, 1]]).all() and torch.isfinite(out[2:]).all()
    assert mask_early_stops(logits, params, 0, 3, torch.arange(4)) is logits
    beyond = SamplingParams(min_tokens=3, stop_token_ids=(10**6,))  # outside the vocabulary: nothing to mask
    masked = mask_early_stops(logits, beyond, 0, 0, torch.arange(4))
    assert torch.isinf(masked[:3, 0]).all() and torch.isfinite(masked[3]).all()
    ignoring = SamplingParams(min_tokens=3, ignore_eos=True)
    assert torch.isfinite(mask_early_stops(logits, ignoring, 0, 0, torch.arange(4))[:, 0]).all()


def test_processed_logprobs_follow_the_sampling_distribution() -> None:
    greedy = processed_logprobs(LOGITS, SamplingParams(temperature=0))
    assert torch.allclose(greedy, torch.log_softmax(LOGITS, -1))  # temperature 1: informative, top-1 = argmax
    params = SamplingParams(temperature=0.5, top_k=3)
    lp = processed_logprobs(LOGITS, params)
    assert torch.allclose(lp.exp(), logits_to_probs(LOGITS, params), atol=1e-7)
    assert torch.isinf(lp[0, [3, 4]]).all()
    entries = token_logprobs(LOGITS, params, [3], None, None)  # an excluded token is reported at the floor
    assert entries[0].logprob == LOGPROB_FLOOR and [t for t, _ in entries[0].top] == []
    entries = token_logprobs(LOGITS, SamplingParams(temperature=0.5, top_k=3, logprobs=2), [1], None, None)
    assert [t for t, _ in entries[0].top] == [0, 1] and entries[0].top[1][1] == entries[0].logprob


@pytest.mark.parametrize("method", [None, "eagle", "medusa"])
def test_choices_of_one_prompt_share_one_prefill(tiny_llama_dir: Path, tmp_path: Path, method: str | None) -> None:
    """Every choice decodes as a lone request would, drafts and acceptance included (a head reads the copied
    prefill's features), and the prompt runs through the target once."""
    torch.set_num_threads(1)
    spec = None
    if method is not None:
        target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
        save_head(new_head(target, method, torch.arange(0, target.config.vocab_size, 2), seed=5), tmp_path)
        spec = {"method": method, "model": str(tmp_path), "num_speculative_tokens": 3, "draft_tree_width": 1}
    # Without the pool: the choices' one prefill is the lone request's own, not a pooled copy of it.
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", max_model_len=128, speculative_config=spec,
              enable_prefix_caching=False)
    prompt = llm.tokenizer.encode("def add(a, b):")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    lone = llm.run_sequences([llm.new_sequence(prompt, params)])[0]
    model = llm.target.model
    prompt_forwards = 0
    forward = model.forward

    def counting(ids: torch.Tensor, positions: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        nonlocal prompt_forwards
        prompt_forwards += int(positions[0, 0] == 0)  # a prefill starts at position 0
        return forward(ids, positions, *args, **kw)

    group = object()
    seqs = [llm.new_sequence(prompt, params) for _ in range(3)]
    for s in seqs:
        s.prefill_group = group
    model.forward = counting  # type: ignore[method-assign]
    try:
        llm.run_sequences(seqs)
    finally:
        del model.forward
    assert prompt_forwards == 1
    for s in seqs:
        assert s.output_ids == lone.output_ids
        assert s.stats.to_dict()["accepted_tokens"] == lone.stats.to_dict()["accepted_tokens"]
    if method is not None:
        assert lone.stats.to_dict()["draft_tokens"] > 0


@pytest.mark.parametrize(("method", "pool"), [(None, True), ("eagle", True), ("eagle", False)])
def test_choices_share_a_chunked_prefill_and_the_prefix_pool(tiny_llama_dir: Path, tmp_path: Path,
                                                             method: str | None, pool: bool) -> None:
    """With the pool on and chunked prefill beside a decoding row, a request's choices prefill its prompt once
    (the siblings copy it, partial last block included) and decode as a lone request would; a second request of
    the same prompt reads all but its last token from the pool, and every choice reports the shared cached
    tokens."""
    torch.set_num_threads(1)
    spec = None
    if method is not None:
        target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
        save_head(new_head(target, method, torch.arange(0, target.config.vocab_size, 2), seed=5), tmp_path)
        spec = {"method": method, "model": str(tmp_path), "num_speculative_tokens": 3, "draft_tree_width": 1}
    prompt = list(range(3, 3 + 37))  # two full 16-token blocks and a partial one
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), dtype="fp32", enable_prefix_caching=False, max_num_batched_tokens=None)
    want = plain.generate([prompt], params)[0].token_ids
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec, max_num_batched_tokens=16,
              enable_prefix_caching=pool)
    engine = llm.batch_engine(max_num_seqs=4)
    prefilled = 0
    prefill = engine._prefill

    def counting(r: object, row: int, n: int) -> None:
        nonlocal prefilled
        prefilled += n
        prefill(r, row, n)  # type: ignore[arg-type]

    engine._prefill = counting  # type: ignore[method-assign]
    drafts: dict[str, list[list[int]]] = {}  # by request id: an object id may be reused by a later request
    if engine.proposer is not None:
        propose = engine.proposer.propose

        def recording(asks: list[ProposeRow]) -> list[Draft]:
            out = propose(asks)
            seqs_by_key = {r.key: r.seq for r in engine.running}
            for ask, d in zip(asks, out, strict=True):
                drafts.setdefault(seqs_by_key[ask.key].request_id, []).append(d.tokens)
            return out

        engine.proposer.propose = recording  # type: ignore[method-assign]
    for cached in (0, len(prompt) - 1 if pool else 0):
        runner = llm.new_sequence([5, 6, 7], SamplingParams(max_tokens=25, temperature=0, ignore_eos=True))
        engine.add(runner)
        engine.step()  # the runner's prefill and first token
        engine.step()  # it decodes, and keeps decoding while the choices' prompt comes in by chunks
        prefilled = 0
        if llm.lookup is not None:
            llm.lookup.store.clear()  # the first pass's answers would be guessed alone, and nothing drafted
        group = object()
        seqs = [llm.new_sequence(prompt, params) for _ in range(3)]
        for s in seqs:
            s.prefill_group = group
            engine.add(s)
        while engine.has_work():
            engine.step()
        assert prefilled == len(prompt) - cached
        assert [s.output_ids for s in seqs] == [want] * 3
        assert [s.cached_tokens for s in seqs] == [cached] * 3
        accepted = {s.stats.to_dict()["accepted_tokens"] for s in seqs}
        assert len(accepted) == 1
        if method is not None:  # the same tokens and features: each choice drafts what the source drafts
            assert seqs[0].stats.to_dict()["draft_tokens"] > 0
            first = drafts[seqs[0].request_id]
            assert first and all(drafts[s.request_id] == first for s in seqs)
        assert not engine._shares  # no finished prefill outlives its choices
