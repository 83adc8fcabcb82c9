"""Grafting a prompt-lookup guess onto a draft tree (pure functions, literal trees)."""

from __future__ import annotations

import torch

from specdecode.engine.lookup_guess import RowGuess, with_lookup_branch
from specdecode.proposers.base import Draft
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.proposers.tree_growth import graft_chain
from specdecode.tree import build_tree

# Root children 10, 11; 10 -> 12; 11 -> 13.
TOKENS, PARENTS = [10, 11, 12, 13], [0, 0, 1, 2]


def test_graft_shares_the_existing_prefix() -> None:
    tokens, parents = graft_chain(TOKENS, PARENTS, [10, 12, 20, 21])
    assert tokens == [10, 11, 12, 13, 20, 21]
    assert parents == [0, 0, 1, 2, 3, 5]  # 20 hangs under node 3 (10 -> 12), 21 under 20
    build_tree([-1, *parents])  # a valid tree: parents before children


def test_graft_a_new_branch_and_an_already_present_path() -> None:
    assert graft_chain(TOKENS, PARENTS, [30, 31]) == ([10, 11, 12, 13, 30, 31], [0, 0, 1, 2, 0, 5])
    assert graft_chain(TOKENS, PARENTS, [11, 13]) == (TOKENS, PARENTS)
    assert graft_chain([], [], [5, 6]) == ([5, 6], [0, 1])


def test_graft_stops_at_the_node_limit() -> None:
    assert graft_chain(TOKENS, PARENTS, [10, 12, 20, 21], max_nodes=5) == ([10, 11, 12, 13, 20], [0, 0, 1, 2, 3])
    assert graft_chain(TOKENS, PARENTS, [30], max_nodes=4) == (TOKENS, PARENTS)


def test_with_lookup_branch() -> None:
    tree = Draft(list(TOKENS), None, list(PARENTS))
    history = [1, 2, 3, 40, 41, 42, 1, 2, 3]  # the suffix 1 2 3 was followed by 40 41 42
    guess = RowGuess(history, SuffixSource(2))
    out = with_lookup_branch(tree, guess, 2)
    assert (out.tokens, out.parents, out.probs) == ([10, 11, 12, 13, 40, 41], [0, 0, 1, 2, 0, 5], None)
    assert with_lookup_branch(tree, RowGuess(history, None), 2) is tree  # lookup off
    assert with_lookup_branch(tree, RowGuess([7, 8, 9], SuffixSource(2)), 2) is tree  # no guess
    chain = Draft([10, 12], torch.rand(2, 50))
    assert with_lookup_branch(chain, guess, 2) is chain  # chains stay chains
