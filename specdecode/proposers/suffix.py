"""Suffix decoding as a batch proposer: each row drafts a tree of what followed earlier occurrences of its
suffix, in its own text and in the earlier answers of its scope (suffix_source.py), the most likely nodes first.
Drafting reads no model, so it is free. The engine prices a row's draft of k as k nodes, as a chain's: the tree
holds at most k nodes, the most likely ones, so its side branches take the place of the least likely deep nodes
and the forward costs what the cost model charged; nodes less likely than `MIN_NODE_PROB` are left out."""

from __future__ import annotations

import math

import torch

from specdecode.cost_model import CostModel
from specdecode.proposers.base import Capabilities, Draft, ProposeRow, SequenceView
from specdecode.proposers.suffix_source import SuffixSource

MIN_NODE_PROB = 0.1
"""Least estimated chance a draft node needs (the share of occurrences that continued that way)."""
SPEC_FACTOR = 1.0
"""Draft nodes per matched suffix token at most: a long match is a copy that tends to go on, a short one a guess
that tends to stop soon, and the nodes it would not keep cost verification."""


class SuffixRows:
    """A `BatchProposer` drafting every row's suffix tree."""

    name = "suffix"
    capabilities = Capabilities(lookup=True)  # priced as a chain of k nodes (the module doc)

    def __init__(self, source: SuffixSource) -> None:
        self.source = source

    def configure(self, cost: CostModel) -> None:
        pass

    def reserve(self, rows: int) -> None:
        pass

    def begin(self, key: int, seq: SequenceView) -> None:
        pass

    def release(self, key: int) -> None:
        pass

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        drafts = []
        for r in rows:
            trie = self.source.trie(r.seq.token_ids, r.seq.tenant, r.k, shared=r.seq.params.greedy)
            tree = trie.tree(min(r.k, math.ceil(SPEC_FACTOR * trie.match_length)), MIN_NODE_PROB)
            drafts.append(Draft(tree.tokens, None, tree.parents))
        return drafts

    def observe_hidden(self, key: int, hidden: torch.Tensor) -> None:
        pass

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        pass

    def catch_up_tokens(self, key: int, seq: SequenceView) -> int:
        return 0

    def step_cost_hint(self) -> float:
        return 0.0

    def catch_up_token_seconds(self) -> float:
        return 0.0

    def state_bytes(self, rows: int) -> int:
        return 0
