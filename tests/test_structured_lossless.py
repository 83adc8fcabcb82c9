"""Constrained speculative sampling has the constrained target distribution, through the engine.

The Markov-chain target of tests/test_engine_lossless.py (logits depend only on the last token), a token
grammar that allows three of the six tokens after most tokens (a stand-in `TokenMatcher`, so the test sees
the engine's masking and pruning, not a grammar engine's), a random draft model drafting sampled chains
(with their probabilities) and trees of point masses. The joint of the first three
tokens must pass a chi-square test against the exact constrained chain (each row masked, renormalised
after temperature and top-p). One token forces the next, so drafts also carry grammar-forced nodes.
The draft sees the grammar (its q masked) or not (its forbidden tokens cut by the engine). Two negative
controls must fail: dropping a sampled chain's forbidden token (the next token then comes from the masked
target p instead of the residual max(p - q, 0): same support, wrong law, caught by the chi-square), and
applying the grammar's mask at the root of each draft only (the target's distributions deeper in the
draft are unconstrained: forbidden sequences, or a failing chi-square).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from stat_helpers import chi_square_pvalue, histogram, markov_joint
from test_engine_lossless import DRAFT, NUM_EMITTED, PROMPT, TARGET, VOCAB, _NoText, _transition_logits

from specdecode.engine import constrain
from specdecode.engine.core import Engine
from specdecode.engine.sequence import Sequence
from specdecode.proposers.draft_rows import DraftModelRows
from specdecode.sampling import SamplingParams

NUM_REQUESTS = 1000
PARAMS = dict(temperature=1.5, top_p=0.95, max_tokens=4, ignore_eos=True)
"""Flat enough that the masked target is rarely a point mass (where residual and target coincide)."""
P_THRESHOLD = 1e-3
ALLOWED = {0: (1, 2, 4), 1: (0, 3, 5), 2: (1, 2, 3), 3: (0, 4, 5), 4: (2, 3, 5), 5: (0,)}
"""Tokens the grammar allows after each token; after 5 it forces 0 (a forced draft token)."""


class MarkovGrammar:
    """A `TokenMatcher` whose allowed set depends on the last token consumed."""

    def __init__(self, last: int) -> None:
        self.path = [last]

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        mask[list(ALLOWED[self.path[-1]])] = True
        return mask

    def consume(self, token: int) -> bool:
        if token not in ALLOWED[self.path[-1]]:
            return False  # refused, not consumed (as llguidance's try_consume)
        self.path.append(token)
        return True

    def rollback(self, n: int) -> None:
        del self.path[len(self.path) - n :]

    def is_stopped(self) -> bool:
        return False

    def forced(self) -> list[int]:
        forced, last = [], self.path[-1]
        while len(ALLOWED[last]) == 1:
            last = ALLOWED[last][0]
            forced.append(last)
            if len(forced) == 3:
                break
        return forced


def _sample(tree_width: int, k: int, monkeypatch: pytest.MonkeyPatch | None = None) -> np.ndarray:
    """`monkeypatch` given: the draft does not see the grammar (its forbidden tokens are cut by the engine)."""
    if monkeypatch is not None:
        view = Sequence.view
        monkeypatch.setattr(Sequence, "view", lambda self: dataclasses.replace(view(self), matcher=None))
    proposer = DraftModelRows(DRAFT, 32, tree_width=tree_width, tree_branching=2)
    engine = Engine(TARGET, 32, proposer, k_max=k, fixed_k=k, max_num_seqs=16, max_waiting=None)
    seqs = [Sequence(str(i), PROMPT, SamplingParams(seed=i, **PARAMS), _NoText(), VOCAB, torch.device("cpu"), 0,
                     matcher=MarkovGrammar(PROMPT[-1])) for i in range(NUM_REQUESTS)]
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        engine.step()
    assert sum(s.stats.accepted_tokens for s in seqs) > NUM_REQUESTS // 4  # drafts were verified and kept
    return histogram([s.output_ids for s in seqs], VOCAB, NUM_EMITTED)


def _exact() -> np.ndarray:
    logits = _transition_logits()  # [V, V]
    for last, allowed in ALLOWED.items():
        forbidden = [t for t in range(VOCAB) if t not in allowed]
        logits[last, forbidden] = float("-inf")
    params = SamplingParams(temperature=PARAMS["temperature"], top_p=PARAMS["top_p"])
    return markov_joint(logits, params, PROMPT[-1], NUM_EMITTED)


@pytest.mark.parametrize(("tree_width", "k"), [(1, 2), (2, 2)], ids=["chain", "tree"])
def test_constrained_speculative_sampling_is_lossless(tree_width: int, k: int) -> None:
    p = chi_square_pvalue(_sample(tree_width, k), _exact())
    assert p > P_THRESHOLD, p


def test_grammar_unaware_sampled_draft_is_lossless(monkeypatch: pytest.MonkeyPatch) -> None:
    p = chi_square_pvalue(_sample(1, 2, monkeypatch), _exact())
    assert p > P_THRESHOLD, p


def test_negative_control_dropping_a_forbidden_sampled_token_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cutting a sampled chain before its forbidden token makes the next token come from p instead of the
    residual max(p - q, 0) of the distribution the token was drawn from: same support, wrong law."""
    real = constrain._walk_sampled_chain

    def drop_forbidden(row, matcher):  # noqa: ANN001, ANN202
        kept, masks = real(row, matcher)
        last = kept[-1]
        if len(kept) > 1 and not bool(masks[kept[-2]][row.tokens[last]]):
            kept = kept[:-1]
        return kept, masks

    monkeypatch.setattr(constrain, "_walk_sampled_chain", drop_forbidden)
    p = chi_square_pvalue(_sample(1, 2, monkeypatch), _exact())
    assert p < P_THRESHOLD, p


def test_negative_control_mask_at_the_root_only_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = constrain.constrain_row

    def root_only(row, matcher, forced_room=0):  # noqa: ANN001, ANN202
        pruned, masks = real(row, matcher, forced_room)
        masks[1:] = True  # the draft's positions see the unconstrained target
        return pruned, masks

    monkeypatch.setattr("specdecode.engine.constrain.constrain_row", root_only)
    observed = _sample(1, 2)
    exact = _exact()
    if observed[exact == 0].sum() > 0:
        return  # sampled sequences the constrained chain cannot produce: caught outright
    p = chi_square_pvalue(observed, exact)
    assert p < P_THRESHOLD, p
