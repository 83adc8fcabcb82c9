"""Choosing how much of a grown draft tree to verify (pure functions)."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.cost_model import CostModel
from specdecode.proposers.nodes_worth_verifying import TreeValue, best_node_count
from specdecode.proposers.tree_growth import grow_tree, prune_to_best


def flat_then_linear(t: int) -> float:
    """A memory-bound target: up to 8 tokens cost one forward, then each token 10% more."""
    return 1.0 if t <= 8 else 1.0 + 0.1 * (t - 8)


def test_best_node_count_weighs_probability_against_forward_cost():
    probs = [0.9, 0.6, 0.3, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01]
    # free up to 7 nodes: keep them all; beyond, a 0.03-probability node is not worth 10% more time
    assert best_node_count(probs, 1.0, 0.0, flat_then_linear) == 7
    # a drafter that is right half as often as it claims: same choice while nodes are free
    assert best_node_count(probs, 0.5, 0.0, flat_then_linear) == 7
    # cost linear in tokens: 1.9/2 beats 2.5/3 and 2.8/4, so one node; a costly draft favours more
    linear = lambda t: float(t)
    assert best_node_count([0.9, 0.6, 0.3], 1.0, 0.0, linear) == 1
    assert best_node_count([0.9, 0.6, 0.3], 1.0, 5.0, linear) == 2
    assert best_node_count([], 1.0, 0.0, linear) == 0


def _rate(probs: list[float], cal: float, draft: float, n: int) -> float:
    return (1 + cal * sum(probs[:n])) / (draft + 1.0 + 0.05 * (n + 1) ** 2)


def test_best_node_count_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        probs = sorted(torch.rand(12, generator=gen).tolist(), reverse=True)
        cal, draft = float(torch.rand(1, generator=gen)) * 2, float(torch.rand(1, generator=gen))
        n = best_node_count(probs, cal, draft, lambda t: 1.0 + 0.05 * t * t)
        assert _rate(probs, cal, draft, n) == pytest.approx(max(_rate(probs, cal, draft, m) for m in range(1, 13)))


def test_tree_value_learns_its_calibration():
    value = TreeValue(flat_then_linear, decay=0.5, prior_weight=1.0)
    assert value.calibration == 1.0
    value.observe(3)  # nothing handed out yet: nothing to learn
    assert value.calibration == 1.0
    assert value.keep([0.9, 0.8, 0.7], 0.0) == 3
    value.observe(0)  # predicted 2.4, none accepted
    assert value.calibration == pytest.approx(1.0 / 3.4)
    value.keep([0.5], 0.0)
    value.observe(1)
    assert value.calibration == pytest.approx((1 + 1.0) / (0.5 * 2.4 + 0.5 + 1.0))
    value.reset()
    assert value.calibration == 1.0


def test_prune_keeps_a_subtree_in_level_order():
    #        root
    #       /    \
    #     1(a)   2(b)
    #     /  \      \
    #  3(c) 4(d)    5(e)
    tokens, parents = [10, 20, 30, 40, 50], [0, 0, 1, 1, 2]
    scores = [math.log(p) for p in (0.6, 0.3, 0.3, 0.2, 0.25)]
    toks, pars = prune_to_best(tokens, parents, scores, lambda probs: 3)
    assert (toks, pars) == ([10, 20, 30], [0, 0, 1])  # ties (0.3) go to the earlier node
    toks, pars = prune_to_best(tokens, parents, scores, lambda probs: 4)
    assert (toks, pars) == ([10, 20, 30, 50], [0, 0, 1, 2])  # node 5 renumbered 4, its parent 2 kept
    seen = []
    prune_to_best(tokens, parents, scores, lambda probs: seen.extend(probs) or 0)
    assert seen == pytest.approx([0.6, 0.3, 0.3, 0.25, 0.2])
    assert prune_to_best(tokens, parents, scores, lambda probs: 0) == ([10], [0])  # at least one node


def test_grow_tree_select_cuts_the_grown_tree():
    vocab = 6
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]))

    def expand(level):  # every node: the same distribution, shifted by its token
        return torch.stack([logits.roll(int(t)) for t in level.tokens])

    full = grow_tree(logits, 3, 4, 2, 5, expand)
    assert len(full.tokens) == 2 + 4 + 4  # the root has 2 children (branching), then 4 per level
    cut = grow_tree(logits, 3, 4, 2, 5, expand, select=lambda probs: 5)
    assert len(cut.tokens) == 5
    for i, p in enumerate(cut.parents):  # parents come before children
        assert p <= i
    assert cut.tokens[0] == 0 and vocab == 6


def test_the_engine_feeds_a_tree_proposers_calibration(plain_tiny, tiny_llama_dir) -> None:
    """The engine configures a dynamic-tree proposer (its TreeValue) with its cost and reports every step."""
    from tiny_helpers import GREEDY, record_rows, tiny_prompts

    from specdecode import LLM

    base, ref = plain_tiny
    # adaptive k (no num_speculative_tokens): the engine measures its costs, and so sets the TreeValue
    llm = LLM(str(tiny_llama_dir), dtype="fp32",
              speculative_config={"method": "draft", "model": str(tiny_llama_dir), "draft_tree_width": 0})
    made = record_rows(llm)
    assert llm.engine.cost is not None
    # A known cost (a drafted token a tenth of a forward) in place of the measured one: with the target as its
    # own draft the measured costs sit at break-even, where timing noise alone would decide whether it drafts.
    llm.engine.cost = CostModel.from_points({1: 0.010, 9: 0.012}, 9, draft_step_seconds=0.001)
    outs = llm.generate(tiny_prompts(base)[:1], GREEDY)
    value = made[-1].tree_value
    assert value is not None
    assert outs[0].token_ids == ref[0]
    assert value.predicted > 0 and value.accepted > 0  # the draft is the target itself: trees get accepted
