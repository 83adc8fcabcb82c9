"""Statistical losslessness through the engine: batched steps, chains and trees, temperature and top-p.

The target is a one-layer model whose attention and MLP outputs are zeroed, so its next-token logits
depend only on the last token: a Markov chain over a 6-token vocabulary, whose exact distribution of the
first three sampled tokens is a finite product (`markov_joint`), i.e. what plain sampling draws. Requests
run 16 at a time through `Engine` with a random draft model that drafts every row in one forward (a sampled
chain, with its probabilities, or a tree of point masses; or, over another vocabulary, a greedy chain whose text
is re-tokenized into the target's letters; or a sampled chain from an output matrix missing some ids); the
histogram of their first three tokens must pass a chi-square test against that distribution. The negative
control verifies without the residual distribution (a rejected candidate's mass is not removed before the
next candidate or the recovered token): it must fail.
Every request has its own seed, so the test is deterministic.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from stat_helpers import chi_square_pvalue, histogram, markov_joint

from specdecode.engine.core import Engine
from specdecode.engine.sequence import Sequence
from specdecode.model.config import ModelConfig
from specdecode.model.output_rows import restrict_output
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import BatchProposer
from specdecode.proposers.cross_vocab_rows import CrossVocabDraftRows
from specdecode.proposers.draft_rows import DraftModelRows
from specdecode.proposers.suffix import SuffixRows
from specdecode.proposers.suffix_index import SuffixStore
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.proposers.text_bridge import TextBridge
from specdecode.sampling import SamplingParams
from specdecode.verify import tree as tree_verify

VOCAB = 6
PROMPT = [0, 3, 1]
NUM_EMITTED = 3
NUM_REQUESTS = 1200
P_THRESHOLD = 1e-3
PARAMS = dict(temperature=0.8, top_p=0.9, max_tokens=4, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


class _NoText:
    """Tokenizer stand-in: no EOS, no text (stop rules never fire)."""

    eos_token_id = -1

    def decode(self, ids: list[int]) -> str:
        return ""


def _model(seed: int, markov: bool, vocab: int = VOCAB) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
                      max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
            if markov:  # the residual stream stays the last token's embedding
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return model.fuse_projections().eval()


TARGET = _model(0, markov=True)
DRAFT = _model(1, markov=False)
CUT_DRAFT = _model(3, markov=False)
restrict_output(CUT_DRAFT, torch.tensor([0, 1, 2, 4]))
"""A draft over a draft vocabulary: ids 3 and 5 have draft probability 0."""
CROSS_DRAFT = _model(2, markov=False, vocab=8)
"""A draft over another vocabulary: the target's six letters in another order, and "ab" and "cd" merged."""


def _letters(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=merges)))


def _cross_bridge() -> TextBridge:
    target = _letters({c: i for i, c in enumerate("abcdef")}, [])
    draft = _letters({**{c: i for i, c in enumerate("fedcba")}, "ab": 6, "cd": 7}, [("a", "b"), ("c", "d")])
    return TextBridge(target, draft)


def _transition_logits() -> torch.Tensor:
    """[V, V]: row t = the target's logits after token t (any context)."""
    with torch.inference_mode():
        rows = [TARGET.compute_logits(TARGET(torch.tensor([[t]]), torch.tensor([[0]]), TARGET.new_cache(1, 4))[0])
                for t in range(VOCAB)]
    return torch.cat(rows)


def _sample(tree_width: int, k: int, drafter: str = "draft") -> np.ndarray:
    """`drafter`: "draft" (the random draft model), "draft+suffix" (with the suffix source's guesses grafted or
    riding along), "suffix" (trees of what earlier answers did after the suffix: point masses from data) or
    "cross" (a draft over another vocabulary: its greedy continuation re-tokenized, a point mass) or "cut" (a
    draft whose output matrix lacks two of the ids)."""
    lookup = SuffixSource(1, SuffixStore("global")) if "suffix" in drafter else None
    proposer: BatchProposer
    if drafter == "suffix":
        proposer = SuffixRows(lookup)
    elif drafter == "cross":
        proposer = CrossVocabDraftRows(CROSS_DRAFT, 32, _cross_bridge())
    elif drafter == "cut":
        proposer = DraftModelRows(CUT_DRAFT, 32, tree_width=tree_width, tree_branching=2)
    else:  # every row in one forward
        proposer = DraftModelRows(DRAFT, 32, tree_width=tree_width, tree_branching=2, prompt_lookup=lookup)
    engine = Engine(TARGET, 32, proposer, k_max=k, fixed_k=k, max_num_seqs=16, max_waiting=None, lookup=lookup)
    seqs = [Sequence(str(i), PROMPT, SamplingParams(seed=i, **PARAMS), _NoText(), VOCAB, torch.device("cpu"), 0)
            for i in range(NUM_REQUESTS)]
    for s in seqs:
        engine.add(s)
    drafted = 0
    while engine.has_work():
        engine.step()
    drafted = sum(s.stats.draft_tokens for s in seqs)
    assert drafted > NUM_REQUESTS  # every request verified drafts (in a batch of 16)
    return histogram([s.output_ids for s in seqs], VOCAB, NUM_EMITTED)


def _exact() -> np.ndarray:
    params = SamplingParams(temperature=PARAMS["temperature"], top_p=PARAMS["top_p"])
    return markov_joint(_transition_logits(), params, PROMPT[-1], NUM_EMITTED)


CASES = [(1, 2, "draft"), (2, 2, "draft"), (1, 2, "draft+suffix"), (2, 2, "draft+suffix"), (0, 3, "suffix"),
         (1, 3, "cross"), (1, 2, "cut")]
IDS = ["chain", "tree", "chain+suffix", "tree+suffix", "suffix", "cross-vocab", "draft-vocab"]


@pytest.mark.parametrize(("tree_width", "k", "drafter"), CASES, ids=IDS)
def test_engine_sampling_is_lossless(tree_width: int, k: int, drafter: str) -> None:
    p = chi_square_pvalue(_sample(tree_width, k, drafter), _exact())
    assert p > P_THRESHOLD, p


@pytest.mark.parametrize(("tree_width", "k", "drafter"), CASES, ids=IDS)
def test_negative_control_without_the_residual_fails(tree_width: int, k: int, drafter: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_verify, "_reject_residual", lambda residual, mass, draft_row, token: residual)
    p = chi_square_pvalue(_sample(tree_width, k, drafter), _exact())
    assert p < P_THRESHOLD, p
