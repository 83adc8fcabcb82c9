"""Suffix decoding as a batch proposer: each row drafts a tree of what followed earlier occurrences of its
suffix, in its own text and in the earlier answers of its scope (suffix_source.py), the most likely nodes first.
Drafting reads no model, so it is free, and it can happen before the schedule: the engine asks each adaptive row's
tree and its nodes' chances first (`node_chances`) and sizes the draft by them, so a long copy that every earlier
occurrence agrees on is drafted far and a weak guess briefly; `propose` then offers the tree cut to the k chosen.
A draft of k nodes is priced as a chain's (k + 1 tokens verified). Nodes less likely than `MIN_NODE_PROB` are left
out. A row with a fixed k drafts the tree of its k most likely nodes, at most `SPEC_FACTOR` per matched token."""

from __future__ import annotations

import math

from specdecode.proposers.base import Capabilities, Draft, LookupRows, ProposeRow, SequenceView
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.proposers.suffix_trie import SuffixTree

MIN_NODE_PROB = 0.1
"""Least estimated chance a draft node needs (the share of occurrences that continued that way)."""
SPEC_FACTOR = 1.0
"""Draft nodes per matched suffix token at most, for a fixed k: a long match is a copy that tends to go on, a
short one a guess that tends to stop soon, and the nodes it would not keep cost verification."""


class SuffixRows(LookupRows):
    """A `BatchProposer` drafting every row's suffix tree, scored (the module doc)."""

    name = "suffix"
    capabilities = Capabilities(lookup=True, scored=True)

    def __init__(self, source: SuffixSource) -> None:
        self.source = source
        self._trees: dict[int, tuple[int, SuffixTree]] = {}  # key -> (tokens it was drafted after, tree)

    def node_chances(self, key: int, seq: SequenceView, depth: int, rate: float) -> list[float]:
        trie = self.source.trie(seq.token_ids, seq.tenant, depth, shared=seq.params.greedy)
        tree = trie.tree(depth, MIN_NODE_PROB)
        self._trees[key] = (len(seq.token_ids), tree)
        return tree.chances(rate)

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        drafts = []
        for r in rows:
            held = self._trees.pop(r.key, None)
            if held is not None and held[0] == len(r.seq.token_ids):  # scored this step: cut to the k chosen
                tree = held[1].first(r.k)
            else:
                trie = self.source.trie(r.seq.token_ids, r.seq.tenant, r.k, shared=r.seq.params.greedy)
                tree = trie.tree(min(r.k, math.ceil(SPEC_FACTOR * trie.match_length)), MIN_NODE_PROB)
            drafts.append(Draft(tree.tokens, None, tree.parents))
        return drafts

    def release(self, key: int) -> None:
        self._trees.pop(key, None)
