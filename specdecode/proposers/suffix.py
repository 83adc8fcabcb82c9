"""Suffix decoding as a batch proposer: each row drafts a tree of what followed earlier occurrences of its
suffix, in its own text and in the earlier answers of its scope (suffix_source.py), the most likely nodes first.
Drafting reads no model, so it is free. The engine prices a row's draft of k as k nodes, as a chain's: the tree
holds at most k nodes, the most likely ones, so its side branches take the place of the least likely deep nodes
and the forward costs what the cost model charged; nodes less likely than `MIN_NODE_PROB` are left out."""

from __future__ import annotations

import math

from specdecode.proposers.base import Draft, LookupRows, ProposeRow
from specdecode.proposers.suffix_source import SuffixSource

MIN_NODE_PROB = 0.1
"""Least estimated chance a draft node needs (the share of occurrences that continued that way)."""
SPEC_FACTOR = 1.0
"""Draft nodes per matched suffix token at most: a long match is a copy that tends to go on, a short one a guess
that tends to stop soon, and the nodes it would not keep cost verification."""


class SuffixRows(LookupRows):
    """A `BatchProposer` drafting every row's suffix tree (priced as a chain of k nodes: the module doc)."""

    name = "suffix"

    def __init__(self, source: SuffixSource) -> None:
        self.source = source

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        drafts = []
        for r in rows:
            trie = self.source.trie(r.seq.token_ids, r.seq.tenant, r.k, shared=r.seq.params.greedy)
            tree = trie.tree(min(r.k, math.ceil(SPEC_FACTOR * trie.match_length)), MIN_NODE_PROB)
            drafts.append(Draft(tree.tokens, None, tree.parents))
        return drafts
