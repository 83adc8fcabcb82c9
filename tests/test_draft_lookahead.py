"""The draft model's prompt-lookup guesses: the same draft tokens as the plain loop, in fewer forwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.model.load import load_model
from specdecode.proposers.base import Draft, ProposeRow, SequenceView
from specdecode.proposers.draft_rows import DraftModelRows
from specdecode.proposers.suffix_source import SuffixSource

LOOKUP = SuffixSource(2)


class BigramModel(torch.nn.Module):
    """A draft whose logits depend mostly on the current token (a fixed random table): its text soon loops,
    so prompt lookup guesses it, as it guesses a real draft copying code from the prompt. A small term from
    the token before, read from what earlier forwards wrote at that position (a stand-in for the KV
    cache), makes a cache left holding a wrong guess change the probabilities."""

    def __init__(self, tiny: torch.nn.Module, vocab: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.tiny, self.config = tiny, tiny.config
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=gen) * 4  # [V, V]
        self.prev_table = torch.randn(vocab, vocab, generator=gen) * 0.05  # [V, V]
        self.device = torch.device("cpu")

    def new_cache(self, batch: int, max_len: int):  # noqa: ANN201 - the real cache keeps the lengths
        self.written = torch.zeros(max_len, dtype=torch.long)  # [max_len]: token per position (one row drafts)
        return self.tiny.new_cache(batch, max_len)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, **_) -> torch.Tensor:  # noqa: ANN001
        self.written[positions[0]] = tokens[0]
        prev = self.written[(positions[0] - 1).clamp(min=0)]  # [m]
        return (self.table[tokens[0]] + self.prev_table[prev])[None]  # [1, m, V]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@pytest.fixture(scope="module")
def draft_model(tiny_llama_dir: Path) -> BigramModel:
    return BigramModel(load_model(tiny_llama_dir, "fp32", "cpu").model)


def _one_row(model, seq: SequenceView, lookup=None) -> DraftModelRows:  # noqa: ANN001
    """The draft proposer with one request (row key 0) begun."""
    rows = DraftModelRows(model, 512, prompt_lookup=lookup)
    rows.begin(0, seq)
    return rows


def _propose(rows: DraftModelRows, seq: SequenceView, k: int) -> Draft:
    return rows.propose([ProposeRow(0, seq, k, k)])[0]


def _own_text(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    """prompt + the draft's own greedy continuation."""
    seq = SequenceView(list(prompt), len(prompt), SamplingParams(temperature=0.0), torch.Generator())
    return prompt + _propose(_one_row(model, seq), seq, n).tokens


def _draft(model, tokens: list[int], params: SamplingParams, k: int, lookup, seed: int):  # noqa: ANN001, ANN202
    gen = torch.Generator().manual_seed(seed)
    seq = SequenceView(list(tokens), 8, params, gen)
    rows = _one_row(model, seq, lookup)
    first = _propose(rows, seq, k)
    # A second step after a partial acceptance: the cache keeps only what the draft agreed with.
    kept = min(2, len(first.tokens))
    seq.token_ids += first.tokens[:kept] + [7]
    rows.on_verified(0, seq, kept, kept)
    second = _propose(rows, seq, k)
    return first, second, rows.forwards, gen.get_state()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_lookup_drafts_the_plain_loops_tokens(draft_model, temperature: float, k: int) -> None:  # noqa: ANN001
    text = _own_text(draft_model, [5, 9, 14, 3, 22, 9, 14, 3], 60)
    params = SamplingParams(temperature=temperature, top_k=20)
    forwards = {}
    for cut in range(20, len(text), 9):
        base = _draft(draft_model, text[:cut], params, k, None, cut)
        fast = _draft(draft_model, text[:cut], params, k, LOOKUP, cut)
        for a, b in zip(base[:2], fast[:2], strict=True):
            a: Draft
            assert a.tokens == b.tokens
            if temperature > 0:
                torch.testing.assert_close(a.probs, b.probs, rtol=1e-5, atol=1e-6)
            else:
                assert a.probs is None and b.probs is None
        assert torch.equal(base[3], fast[3])  # the same uniforms were drawn
        forwards[cut] = (base[2], fast[2])
    saved = sum(b - f for b, f in forwards.values())
    assert all(f <= b for b, f in forwards.values())
    if k > 1:
        assert saved > 0, forwards  # the looping text lets guesses through


def test_penalties_keep_the_plain_loop(draft_model) -> None:  # noqa: ANN001
    text = _own_text(draft_model, [5, 9, 14, 3, 22, 9, 14, 3], 40)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    counts = torch.zeros(64)
    seq = SequenceView(list(text), 8, params, torch.Generator(), output_counts=counts,
                       prompt_mask=torch.zeros(64, dtype=torch.bool))
    rows = _one_row(draft_model, seq, LOOKUP)
    _propose(rows, seq, 6)
    assert rows.forwards == 6  # catch-up + 5 single-token forwards


def test_engine_output_equals_plain_with_and_without_lookup(tiny_llama_dir: Path) -> None:
    prompt = [5, 9, 14, 3, 22, 9, 14, 3, 5, 9, 14, 3]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), dtype="fp32").generate([prompt], params)[0].token_ids
    for lookup in (True, False):
        spec = {"method": "draft", "model": str(tiny_llama_dir), "num_speculative_tokens": 6,
                "draft_prompt_lookup": lookup}
        llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
        out = llm.generate([prompt], params)[0].token_ids
        assert out == plain


def test_engine_auto_k_with_guesses_equals_plain(tiny_llama_dir: Path) -> None:
    prompt = [5, 9, 14, 3, 22, 9, 14, 3, 5, 9, 14, 3] * 3
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), dtype="fp32").generate([prompt], params)[0].token_ids
    spec = {"method": "draft", "model": str(tiny_llama_dir)}
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    assert llm.generate([prompt], params)[0].token_ids == plain
    proposer = llm.engine.proposer  # configured with the engine's measured cost
    assert isinstance(proposer, DraftModelRows) and proposer.target_seconds is not None
