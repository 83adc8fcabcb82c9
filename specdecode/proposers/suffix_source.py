"""Where lookup guesses come from: the row's own text (its prompt and output so far) and the earlier answers of
its scope (suffix_index.py). The longer of the two matches of the row's suffix wins (equal lengths pool their
occurrences); what followed its occurrences, merged into a trie, gives a chain (the most frequent path) or a
tree (the most likely nodes). Both the `suffix` proposer and every drafter's lookup guess read it.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.proposers.ngram_match import match_suffix
from specdecode.proposers.suffix_index import SuffixStore
from specdecode.proposers.suffix_trie import ContinuationTrie

OWN_OCCURRENCES = 64
"""Occurrences in the row's own text read at most (the newest)."""
MAX_MATCH = 16
"""Longest suffix matched: longer matches are rarer and more specific, so their continuations are kept more."""
PROMPT_CONTEXT = 8
"""Prompt tokens kept before an answer in the store (the chat template's turn header and the request's last
words): enough to guess how an answer starts."""


class SuffixSource:
    """Lookup guesses of a row from its own text (suffixes of min_n..MAX_MATCH tokens) and, with a store, from
    earlier answers of its scope."""

    def __init__(self, min_n: int, store: SuffixStore | None = None) -> None:
        if min_n < 1:
            raise ValueError(f"need min_n >= 1, got {min_n}")
        self.min_n, self.store = min_n, store

    def trie(self, tokens: Sequence[int], tenant: str | None, depth: int, shared: bool = True) -> ContinuationTrie:
        """The continuations (up to `depth` tokens) of the longest match of the suffix of `tokens`; `shared`:
        in earlier answers too. A sampled request reads its own text only: its drafts, and so the random numbers
        its verification draws, then depend on nothing else that ran, and a seed reproduces its answer."""
        if depth <= 0:
            return ContinuationTrie([], 0)
        own = match_suffix(tokens, self.min_n, max(self.min_n, MAX_MATCH))
        ends = own.ends[-OWN_OCCURRENCES:][::-1]  # newest first (each has a token after it)
        mine = [list(tokens[int(e) + 1 : int(e) + 1 + depth]) for e in ends]
        theirs = self.store.occurrences(tenant, tokens, MAX_MATCH, depth) if shared and self.store else None
        if theirs is None or theirs.length < max(self.min_n, own.n if mine else 0):
            return ContinuationTrie(mine, depth, own.n if mine else 0)
        if theirs.length > own.n or not mine:
            return ContinuationTrie(theirs.continuations, depth, theirs.length)
        return ContinuationTrie(mine + theirs.continuations, depth, own.n)

    def chain(self, tokens: Sequence[int], tenant: str | None, n: int, shared: bool = True) -> list[int]:
        """Up to n guessed tokens (the most frequent continuation); [] without a match."""
        return self.trie(tokens, tenant, n, shared).chain(n) if n > 0 else []

    def remember(self, tenant: str | None, tokens: Sequence[int], prompt_len: int) -> None:
        """Keep a finished request's answer for later requests of its scope."""
        if self.store is not None and len(tokens) > prompt_len:
            self.store.remember(tenant, tokens[max(0, prompt_len - PROMPT_CONTEXT):])
