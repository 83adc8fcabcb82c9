"""Draft-model trees through the engine: tree attention in one target pass, KV compaction, exactness."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from stat_helpers import block_output_counts
from tiny_helpers import GREEDY, record_rows, run_batched, tiny_prompts

from specdecode import LLM, SamplingParams
from specdecode.cost_model import CostModel
from specdecode.engine.core import Engine
from specdecode.engine.lookup_guess import RowGuess, guess_alone
from specdecode.engine.running import Running
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.sampling import tree_output_counts
from specdecode.tree import build_tree

TREES = [(2, 2, 3), (4, 2, 4), (3, 3, 6)]  # (width, branching, depth)


def _spec(draft: str, width: int, branching: int, depth: int) -> dict:
    return {"method": "draft", "model": draft, "num_speculative_tokens": depth, "draft_tree_width": width,
            "draft_tree_branching": branching}


def _alone(engine: Engine, row: Running, k: int, node_budget: int) -> list[int]:
    """The guess the engine's schedule has the row propose alone at k (no catch-up to pay)."""
    return guess_alone(row, RowGuess(row.seq.token_ids, engine.lookup), k, engine._allowed(row), node_budget, 0.0,
                       engine.row_cost)


def _guess(tokens: list[int], n: int) -> list[int]:
    """The lookup guess of n tokens of a row alone (its own text: min_n 1)."""
    return SuffixSource(1).chain(tokens, None, n)


def _lookup_oracle(guess: Callable[[list[int], int], list[int]]) -> Callable[..., SimpleNamespace]:
    """A suffix source's trie in place of the real one's, whose chain of k tokens is guess(token_ids, k)."""
    return lambda self, token_ids, tenant, depth, *shared: SimpleNamespace(chain=lambda k: guess(list(token_ids), k))


@pytest.mark.parametrize(("width", "branching", "depth"), TREES)
@pytest.mark.parametrize("drafter", ["same", "random"])
def test_tree_greedy_equals_plain(plain_tiny, tiny_llama_dir: Path, tiny_llama_other_dir: Path, drafter: str,
                                  width: int, branching: int, depth: int) -> None:
    base, ref = plain_tiny
    draft = tiny_llama_dir if drafter == "same" else tiny_llama_other_dir
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=_spec(str(draft), width, branching, depth))
    outs = llm.generate(tiny_prompts(base), GREEDY)
    assert [o.token_ids for o in outs] == ref
    m = outs[0].metrics
    if drafter == "same":
        # The draft is the target: the first level's best candidate is always the target's argmax.
        assert m["acceptance_by_position"][0] == 1.0
        assert m["mean_accepted_length"] > 2.0
    else:
        assert m["accepted_tokens"] <= 0.15 * m["steps"] * depth
    assert m["draft_tokens"] > m["steps"]  # trees propose more nodes than positions


@pytest.mark.real
def test_tree_greedy_equals_plain_smollm() -> None:
    base = LLM("smollm2-135m-instruct", dtype="fp32")
    prompts = [base.chat_prompt_ids([{"role": "user", "content": "Write a Python function that adds numbers."}])]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in base.generate(prompts, params)]
    llm = LLM("smollm2-135m-instruct", dtype="fp32", speculative_config=_spec("smollm2-135m-instruct", 3, 2, 4))
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref


def test_tree_sampling_respects_limits_and_is_seeded(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=_spec(str(tiny_llama_dir), 3, 2, 4))
    params = SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.2, seed=7)
    a = llm.generate(tiny_prompts(llm), params)
    b = llm.generate(tiny_prompts(llm), params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 15 for o in a)


def test_tree_output_counts_follow_each_path() -> None:
    # root(0) -> 1 -> 3, root -> 2; node tokens: root 9 (pending, already counted), 4, 5, 4
    buffers = build_tree([-1, 0, 0, 1])
    tokens = torch.tensor([9, 4, 5, 4])
    base = torch.zeros(10, dtype=torch.long)
    base[7] = 1
    counts = tree_output_counts(base, buffers.attn_mask, tokens)  # [4, 10]
    assert counts[0].tolist() == base.tolist()  # the root's distribution sees only the output so far
    assert counts[1, 4] == 1 and counts[1, 5] == 0
    assert counts[2, 5] == 1 and counts[2, 4] == 0
    assert counts[3, 4] == 2 and counts[3, 7] == 1 and counts[3, 9] == 0


def test_tree_output_counts_on_a_chain_are_the_block_counts() -> None:
    # A chain is a tree with one branch: each node sees the drafts before it, as a verified block does.
    tokens = torch.tensor([9, 4, 4, 1, 7])  # the pending token, then four drafts
    base = torch.tensor([0, 2, 0, 0, 0, 0, 0, 1, 0, 3])
    chain = tree_output_counts(base, build_tree([-1, 0, 1, 2, 3]).attn_mask, tokens)  # [5, 10]
    assert torch.equal(chain, block_output_counts(base, tokens[1:]))


def test_tree_with_lookup_branch_equals_plain(plain_tiny, tiny_llama_dir: Path, tiny_llama_other_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A random drafter's trees plus a grafted guess that is the target's own continuation (an oracle in
    place of prompt lookup): the guess branch is accepted through the tree, and the output stays exact."""
    base, ref = plain_tiny
    prompts = tiny_prompts(base)

    def oracle(token_ids: list[int], k: int) -> list[int]:
        i = next(i for i, p in enumerate(prompts) if token_ids[: len(p)] == p)
        return ref[i][len(token_ids) - len(prompts[i]):][:k]

    monkeypatch.setattr("specdecode.proposers.suffix_source.SuffixSource.trie", _lookup_oracle(oracle))
    for k in (4, "auto"):
        spec = {**_spec(str(tiny_llama_other_dir), 2, 2, 4), "num_speculative_tokens": k}
        llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
        made = record_rows(llm)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == ref
        if k == 4:  # (auto: the cost model of this tiny pair may pick short trees)
            assert all(o.metrics["mean_accepted_length"] > 3.0 for o in outs)  # the random tree alone gets ~1
    # The drafter's calibration counts only what its own nodes got accepted, not the guess's run.
    values = [row.tree_value for row in made]
    assert values and all(v is not None and v.accepted < 0.25 * v.predicted + 1.0 for v in values)


def test_tree_branching_defaults_per_method() -> None:
    """EAGLE expands each node into its top 4 tokens by default, the others into 2; a set value wins; bad ones
    are refused at start-up."""
    from specdecode.config import SpeculativeConfig

    assert SpeculativeConfig.from_any({"method": "eagle"}).tree_branching == 4
    assert SpeculativeConfig.from_any({"method": "medusa"}).tree_branching == 2
    assert SpeculativeConfig.from_any({"method": "draft", "model": "d"}).tree_branching == 2
    assert SpeculativeConfig.from_any({"method": "eagle", "draft_tree_branching": 3}).tree_branching == 3
    with pytest.raises(ValueError, match="draft_tree_branching"):
        SpeculativeConfig.from_any({"method": "eagle", "draft_tree_branching": 9})


def test_a_tree_row_proposes_its_lookup_guess_alone_where_that_pays(plain_tiny, tiny_llama_dir: Path,
                                                                    tiny_llama_other_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree row whose prompt-lookup guess promises more tokens per second than its tree (here each draft level
    costs twice a target forward) proposes the guess alone: the drafter is not asked for that row, the guess
    is verified as a chain, and the output stays exact."""
    base, ref = plain_tiny
    # One-token lookups: a random model's text repeats single tokens only.
    spec = {**_spec(str(tiny_llama_other_dir), 2, 2, 3), "prompt_lookup_min": 1}
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    engine = llm.batch_engine(max_num_seqs=2)
    engine.cost = CostModel.from_points({1: 0.01, 64: 0.01}, 64, draft_step_seconds=0.02)
    asked, guessed = [], []
    propose = engine.proposer.propose

    def proposing(asks: list) -> list:
        asked.append(len(asks))
        return propose(asks)

    def guessing(r: Running, guess: RowGuess, k: int, *args) -> list[int]:  # noqa: ANN002
        alone = guess_alone(r, guess, k, *args)
        if k > 0:  # a row that drafts this step: its guess, or its drafter
            guessed.append(bool(alone))
        return alone

    engine.proposer.propose = proposing  # type: ignore[method-assign]
    monkeypatch.setattr("specdecode.engine.core.guess_alone", guessing)
    seqs = run_batched(llm, tiny_prompts(llm), GREEDY, engine=engine)
    assert [s.output_ids for s in seqs] == ref
    assert any(guessed) and not all(guessed)  # guesses where the text repeats, trees elsewhere
    assert sum(asked) == guessed.count(False)  # every row that guessed skipped the drafter


def test_a_row_whose_drafter_does_not_pay_proposes_its_lookup_guess_alone(plain_tiny, tiny_llama_dir: Path,
                                                                        tiny_llama_other_dir: Path) -> None:
    """A draft-model chain whose steps cost ten target forwards never pays, so its rows would decode plainly;
    where the text repeats they propose their lookup guess alone instead (no draft forward), exactly. The n-gram
    proposer, the lookup itself, has no drafter cost to save and never does."""
    base, ref = plain_tiny
    spec = {"method": "draft", "model": str(tiny_llama_other_dir), "prompt_lookup_min": 1}
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    engine = llm.batch_engine(max_num_seqs=2)
    engine.cost = CostModel.from_points({1: 0.01, 64: 0.01}, 64, draft_step_seconds=0.1)
    asked = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda asks: asked.append(len(asks)) or propose(asks)  # type: ignore[method-assign]
    seqs = run_batched(llm, tiny_prompts(llm), GREEDY, engine=engine)
    assert [s.output_ids for s in seqs] == ref
    assert all(s.stats.draft_tokens > 0 for s in seqs) and not asked  # guesses only: the drafter never ran

    ngram = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram", "prompt_lookup_min": 1})
    engine = ngram.batch_engine(max_num_seqs=1)
    engine.add(ngram.new_sequence(list(range(5, 13)) * 3, SamplingParams(max_tokens=8, temperature=0)))
    engine.step()
    assert engine.cost is not None and engine.cost.draft_step_seconds == 0
    row = engine.running[0]
    assert _guess(row.seq.token_ids, 4) and _alone(engine, row, 4, 16) == []


def test_a_guess_proposed_alone_runs_on_past_the_tree_depth(tiny_llama_dir: Path, tiny_llama_other_dir: Path) -> None:
    """A guess matched at the tree's depth k, proposed alone, runs on while the copy goes on: up to the row's own
    cap on k and the nodes its tree would verify, and no further than the tokens the request has left."""
    spec = {"method": "draft", "model": str(tiny_llama_other_dir), "draft_tree_width": 2, "draft_tree_branching": 2,
            "prompt_lookup_min": 1}
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    engine = llm.batch_engine(max_num_seqs=2)
    engine.cost = CostModel.from_points({1: 0.01, 64: 0.01}, 64, draft_step_seconds=0.02)  # a free guess tail
    period = list(range(5, 13))
    for max_tokens in (40, 4):
        engine.add(llm.new_sequence(period * 3, SamplingParams(max_tokens=max_tokens, temperature=0)))
    engine.step()  # the prefills
    long, short = engine.running
    tokens = long.seq.token_ids
    assert _guess(tokens, 8)[:2] == _guess(tokens, 2)  # the copy goes on past depth 2
    assert _alone(engine, long, 2, 16) == _guess(tokens, 8)  # k_max
    assert _alone(engine, long, 2, 5) == _guess(tokens, 5)  # nodes
    # 3 tokens left after the first: a step verifies at most 2 drafts, and emits its own token after them.
    assert short.seq.token_ids == tokens
    assert _alone(engine, short, 2, 16) == _guess(tokens, 2)


def test_rejected_guesses_lower_the_rows_guess_rate_until_it_stops_guessing(
        plain_tiny, tiny_llama_dir: Path, tiny_llama_other_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guesses the target always rejects (each a wrong token, from an oracle in place of prompt lookup): a row
    proposes its guess alone while its guess rate promises more than its drafter's step, the rate falls with
    every rejection, and the row stops guessing (the odd guess still beats a probe of the drafter); the output
    stays exact."""
    base, ref = plain_tiny
    prompts = tiny_prompts(base)
    vocab = base.target.config.vocab_size

    def wrong(token_ids: list[int], k: int) -> list[int]:
        i = next(i for i, p in enumerate(prompts) if token_ids[: len(p)] == p)
        return [(t + 1) % vocab for t in ref[i][len(token_ids) - len(prompts[i]):][:k]]

    monkeypatch.setattr("specdecode.proposers.suffix_source.SuffixSource.trie", _lookup_oracle(wrong))
    llm = LLM(str(tiny_llama_dir), dtype="fp32",
              speculative_config={"method": "draft", "model": str(tiny_llama_other_dir)})
    engine = llm.batch_engine(max_num_seqs=1)
    # A wider forward costs more here, so a guess pays only while it is likely to be kept.
    engine.cost = CostModel.from_points({1: 0.010, 9: 0.030}, 9, draft_step_seconds=0.01)
    guessed = []

    def guessing(*args) -> list[int]:  # noqa: ANN002
        alone = guess_alone(*args)
        guessed.append(bool(alone))
        return alone

    monkeypatch.setattr("specdecode.engine.core.guess_alone", guessing)
    seqs = run_batched(llm, prompts[:1], GREEDY, engine=engine)
    assert seqs[0].output_ids == ref[0]
    # Guesses first; then, the rate fallen, only the odd one where it still beats a probe of the drafter.
    late = guessed[len(guessed) // 2:]
    assert all(guessed[:5]) and sum(late) <= len(late) // 4, guessed
