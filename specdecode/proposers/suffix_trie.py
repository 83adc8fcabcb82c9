"""The tree of what followed a matched suffix: every earlier occurrence's continuation, merged into a trie whose
nodes count how many occurrences went that way. A node's count over the occurrences is the estimated chance that
its path is the text to come, so the best draft of n nodes is the n most likely nodes (each more likely than its
children: a valid subtree), and the best chain follows the most frequent child at each level.

Pure functions over plain ints (docs/design.md): the suffix source (suffix_source.py) gathers the continuations.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SuffixTree:
    """A draft tree of point-mass candidates: parents[i] is node i+1's parent (0 = the pending token)."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    """Estimated chance each node's path is the text to come (the share of occurrences that went that way)."""

    @property
    def score(self) -> float:
        """Expected draft tokens kept, if the estimates hold (the sum of the nodes' chances)."""
        return sum(self.probs)


class ContinuationTrie:
    """The continuations of a suffix's occurrences, merged. Ties between equally frequent branches go to the one
    inserted first, so callers pass the newest occurrence first: recent text predicts best."""

    def __init__(self, continuations: Sequence[Sequence[int]], max_depth: int, match_length: int = 0) -> None:
        self.total = len(continuations)
        self.match_length = match_length
        """Tokens of the suffix whose occurrences these continuations follow."""
        self._children: list[dict[int, int]] = [{}]  # trie node -> {token: child}; node 0 is the root
        self._counts = [self.total]
        self._tokens = [-1]
        for cont in continuations:
            node = 0
            for tok in cont[:max_depth]:
                child = self._children[node].get(tok)
                if child is None:
                    child = len(self._counts)
                    self._children[node][tok] = child
                    self._children.append({})
                    self._counts.append(0)
                    self._tokens.append(int(tok))
                self._counts[child] += 1
                node = child

    def __bool__(self) -> bool:
        return len(self._counts) > 1

    def chain(self, n: int) -> list[int]:
        """Up to n tokens: the most frequent child at each level (the first inserted on a tie)."""
        out, node = [], 0
        while len(out) < n and self._children[node]:
            node = max(self._children[node].values(), key=lambda c: (self._counts[c], -c))
            out.append(self._tokens[node])
        return out

    def tree(self, max_nodes: int, min_prob: float = 0.0) -> SuffixTree:
        """The up to max_nodes most likely nodes (each at least min_prob likely), parents before children."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        if self.total == 0:
            return SuffixTree(tokens, parents, probs)
        heap = [(-self._counts[c] / self.total, c, 0) for c in self._children[0].values()]
        heapq.heapify(heap)  # (-chance, trie node: earlier inserted first on a tie, parent's index in the draft)
        while heap and len(tokens) < max_nodes:
            neg, node, parent = heapq.heappop(heap)
            if -neg < min_prob:
                break
            tokens.append(self._tokens[node])
            parents.append(parent)
            probs.append(-neg)
            index = len(tokens)
            for child in self._children[node].values():
                heapq.heappush(heap, (-self._counts[child] / self.total, child, index))
        return SuffixTree(tokens, parents, probs)
