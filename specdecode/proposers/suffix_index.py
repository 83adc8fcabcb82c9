"""Earlier answers, indexed by where each short n-gram ends in them: the cross-request half of suffix decoding.

A document is one finished answer (with the few prompt tokens before it, the chat template's turn header, so the
start of an answer is guessed too). Every position is indexed under the `KEY_LENGTHS` n-grams ending there. A
query reads the occurrences of its context's last n-gram (the longest key first, newest documents first, at most
`CANDIDATES`), extends each match backwards up to max_n tokens, and returns the continuations of the longest
matches: the same answer as a suffix tree's match node, in memory linear in the tokens held.

`SuffixStore` holds one index per scope ("global": one for the server; "key": one per tenant; "request": none)
under one bound on the tokens held, evicting the least recently added answers first. Thread-safe: engines add
and query from their threads, /metrics reads the totals from another.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

KEY_LENGTHS = (4, 2)
"""N-gram lengths each position is indexed under: the long key finds specific matches among few candidates, the
short one still matches where the long one has none. A match is at least the short key long."""
CANDIDATES = 64
"""Occurrences a query extends at most (the newest): bounds a query's time however common its n-gram."""
SCOPES = ("global", "key", "request")
DEFAULT_MAX_TOKENS = 1 << 17
"""Tokens of earlier answers a store holds by default (at most about 130 MB, `BYTES_PER_TOKEN`)."""
BYTES_PER_TOKEN = 1000
"""Memory per token held, at most: Python's objects for the token and its entry under each key, as tracemalloc
measures it on answers of random tokens, where every n-gram is new (tests/test_suffix_lookup.py); real text
repeats n-grams and holds less."""


@dataclass(frozen=True)
class Occurrences:
    """The earlier occurrences of a context's longest matched suffix."""

    length: int
    """Tokens matched (0: none)."""
    continuations: list[list[int]]
    """What followed each occurrence, newest first."""


NO_MATCH = Occurrences(0, [])


class SuffixIndex:
    """Documents' tokens, and for each n-gram of `KEY_LENGTHS` the positions where it ends in each document."""

    def __init__(self) -> None:
        self._docs: dict[Hashable, list[int]] = {}  # insertion order = age
        self._index: dict[tuple[int, ...], dict[Hashable, list[int]]] = {}
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, doc: Hashable, tokens: Sequence[int]) -> None:
        """Index a document (replacing one of the same name)."""
        self.remove(doc)
        toks = [int(t) for t in tokens]
        self._docs[doc] = toks
        self.tokens += len(toks)
        for n in KEY_LENGTHS:
            for end in range(n - 1, len(toks) - 1):  # an end needs a token after it to continue with
                self._index.setdefault(tuple(toks[end - n + 1 : end + 1]), {}).setdefault(doc, []).append(end)

    def remove(self, doc: Hashable) -> None:
        toks = self._docs.pop(doc, None)
        if toks is None:
            return
        self.tokens -= len(toks)
        for n in KEY_LENGTHS:
            for end in range(n - 1, len(toks) - 1):
                key = tuple(toks[end - n + 1 : end + 1])
                docs = self._index.get(key)
                if docs is not None and docs.pop(doc, None) is not None and not docs:
                    del self._index[key]

    def occurrences(self, context: Sequence[int], max_n: int, depth: int) -> Occurrences:
        """The continuations (up to `depth` tokens) of the longest suffix of `context` (at most max_n tokens)
        found in the documents."""
        for n in KEY_LENGTHS:
            if len(context) < n or n > max_n:
                continue
            docs = self._index.get(tuple(context[-n:]))
            if docs:
                return self._extend(docs, context, n, max_n, depth)
        return NO_MATCH

    def _extend(self, docs: dict[Hashable, list[int]], context: Sequence[int], n: int, max_n: int,
                depth: int) -> Occurrences:
        best, found = n, []  # (doc tokens, end) of the longest matches, newest first
        seen = 0
        for doc in reversed(docs):
            toks = self._docs[doc]
            for end in reversed(docs[doc]):
                m = n
                while m < max_n and m < len(context) and end - m >= 0 and toks[end - m] == context[-1 - m]:
                    m += 1
                if m > best:
                    best, found = m, [(toks, end)]
                elif m == best:
                    found.append((toks, end))
                seen += 1
                if seen >= CANDIDATES:
                    break
            if seen >= CANDIDATES:
                break
        return Occurrences(best, [toks[end + 1 : end + 1 + depth] for toks, end in found])


class SuffixStore:
    """Earlier answers per scope under one bound on the tokens held (least recently added evicted first)."""

    def __init__(self, scope: str = "global", max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if scope not in SCOPES:
            raise ValueError(f"suffix scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        if max_tokens < 0:
            raise ValueError(f"the suffix store's max_tokens must be >= 0, got {max_tokens}")
        self.scope, self.max_tokens = scope, max_tokens
        self._indexes: dict[str | None, SuffixIndex] = {}
        self._age: OrderedDict[tuple[str | None, int], int] = OrderedDict()  # (tenant, doc) -> tokens, oldest first
        self._next = 0
        self._held = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.scope != "request" and self.max_tokens > 0

    def _tenant(self, tenant: str | None) -> str | None:
        return tenant if self.scope == "key" else None

    def remember(self, tenant: str | None, tokens: Sequence[int]) -> None:
        """Add one answer (the prompt's last tokens and the output) to its tenant's index ("key" scope) or to the
        shared one; nothing in "request" scope. An answer longer than the bound keeps its end."""
        if not self.enabled or len(tokens) < 2:
            return
        tokens = tokens[-self.max_tokens:]
        tenant = self._tenant(tenant)
        with self._lock:
            doc, self._next = self._next, self._next + 1
            self._indexes.setdefault(tenant, SuffixIndex()).add(doc, tokens)
            self._age[(tenant, doc)] = len(tokens)
            self._held += len(tokens)
            while self._held > self.max_tokens:
                (old_tenant, old_doc), old_len = self._age.popitem(last=False)
                self._held -= old_len
                index = self._indexes[old_tenant]
                index.remove(old_doc)
                if not len(index):
                    del self._indexes[old_tenant]

    def clear(self) -> None:
        """Forget every answer."""
        with self._lock:
            self._indexes.clear()
            self._age.clear()
            self._held = 0

    def occurrences(self, tenant: str | None, context: Sequence[int], max_n: int, depth: int) -> Occurrences:
        if not self.enabled:
            return NO_MATCH
        with self._lock:
            index = self._indexes.get(self._tenant(tenant))
            return index.occurrences(context, max_n, depth) if index is not None else NO_MATCH

    @property
    def tokens(self) -> int:
        """Tokens held, over every tenant."""
        return self._held

    @property
    def approx_bytes(self) -> int:
        return self.tokens * BYTES_PER_TOKEN
