"""The prefix cache: K/V of finished prompt and response prefixes, reused by later requests that start the same.

Blocks of `block_size` tokens are keyed by a chained hash (a block's key hashes its parent's key and its own
tokens, as in vLLM V1), so a key names the whole prefix up to the block's end and a lookup walks the prompt's
blocks until the first miss. Each entry keeps its tokens and parent key, and a match compares them: a hash
collision can only cost a miss, never a wrong reuse. The pool holds copies (the engine's cache is static per
row), bounded in bytes; the least recently used entries go first, and a match refreshes a chain from its
last block to its first so a chain loses its tail before its head (a parent without children stays useful,
a child without its parent is unreachable).

Reuse is token-exact, as in a radix tree: after the last whole block, a prompt takes the longest run of tokens it
shares with any pooled child of that block (a block it leaves midway, or a row's last, partial block, which is
pooled too, so a conversation's next turn reuses the whole previous one). A partial block is replaced by a
longer one, or by the whole block, that covers it.

Only committed tokens are inserted (slots below a row's length, never a tree's scratch slots or rejected
drafts), and a hit is copied into the row, so speculation never writes into a pooled block.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdecode.model.kv_cache import KVCache

DEFAULT_BLOCK_SIZE = 16


def chain_hashes(tokens: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained keys of the full blocks of `tokens`: key i covers tokens [0, (i + 1) * block_size)."""
    keys = []
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        keys.append(parent)
    return keys


@dataclass
class Block:
    parent: int | None
    tokens: tuple[int, ...]
    k: torch.Tensor  # [L, kvh, block, hd]
    v: torch.Tensor  # [L, kvh, block, hd]
    features: torch.Tensor | None = None
    """The target's features of the block's positions [block, F] for proposers that read them (EAGLE)."""

    def head(self, n: int) -> Block:
        """The block's first n positions (views; the whole block when n covers it)."""
        if n >= len(self.tokens):
            return self
        features = None if self.features is None else self.features[:n]
        return Block(self.parent, self.tokens[:n], self.k[:, :, :n], self.v[:, :, :n], features)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.features is None else self.features.numel() * self.features.element_size()
        return 2 * self.k.numel() * self.k.element_size() + extra


BlockReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
"""(block index i, n) -> copies of k, v [L, kvh, n, hd] and features [n, F] (or None) of block i's first n slots."""


def _shared_length(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """A bounded LRU pool of K/V blocks keyed by chained block hashes."""

    def __init__(self, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.blocks: OrderedDict[int, Block] = OrderedDict()
        """Oldest first: eviction pops from the front."""
        self.children: dict[int | None, set[int]] = {}
        """Parent key -> keys of its pooled children (whole and partial blocks)."""
        self.bytes_used = 0
        self.queried_tokens = 0
        """Prompt tokens looked up (the hit rate's denominator)."""
        self.hit_tokens = 0
        """Prompt tokens served from the pool."""
        self._lock = threading.Lock()
        """`LLM.generate` and a server's engine thread may share the pool; a pooled block is never changed, so
        a caller may read the blocks it got after the lock is released."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def match(self, tokens: list[int], limit: int, need_features: bool = False) -> list[Block]:
        """The pooled blocks covering the longest prefix of tokens[:limit] (counted in the hit rate): whole blocks,
        then at most one block trimmed to the tokens it shares (a view)."""
        with self._lock:
            return self._match(tokens, limit, need_features)

    def insert(self, tokens: list[int], read: BlockReader, has_features: bool = False) -> int:
        """Pool the blocks of `tokens`, the last partial one included (`read` copies their K/V out); returns the
        blocks added. With
        `has_features`, pooled blocks that lack features (pooled by a row whose proposer reads none) get them,
        so a later feature-reading request still matches them."""
        with self._lock:
            return self._insert(tokens, read, has_features)

    def restore(self, cache: KVCache, row: int, tokens: list[int], limit: int, need_features: bool = False,
                ) -> tuple[int, torch.Tensor | None]:
        """Copy the pooled K/V of the longest prefix of tokens[:limit] into `row` of `cache` from slot 0; returns
        the tokens restored and, with `need_features`, their features [n, F] (None when nothing matched)."""
        blocks = self.match(tokens, limit, need_features)
        n = 0
        for block in blocks:
            cache.write_span(row, n, block.k, block.v)
            n += len(block.tokens)
        features = torch.cat([b.features for b in blocks]) if blocks and need_features else None  # type: ignore[misc]
        return n, features

    def remember(self, cache: KVCache, row: int, tokens: list[int], features: torch.Tensor | None) -> int:
        """Pool the committed tokens of `row` of `cache` (`tokens`, cut to the row's length: a stop inside an
        accepted block keeps fewer tokens than slots, and slots past the length hold scratch) with their
        features [>= n, F] where given; returns the blocks added."""
        n = min(cache.lengths[row], len(tokens))
        size = self.block_size

        def read(i: int, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            k, v = cache.read_span(row, i * size, m)
            return k, v, None if features is None else features[i * size : i * size + m].clone()

        return self.insert(tokens[:n], read, has_features=features is not None)

    def clear(self) -> None:
        with self._lock:
            self.blocks.clear()
            self.children.clear()
            self.bytes_used = 0

    def _match(self, tokens: list[int], limit: int, need_features: bool) -> list[Block]:
        found: list[Block] = []
        keys: list[int] = []  # the matched blocks' keys
        parent = None
        for key in chain_hashes(tokens[:limit], self.block_size):
            block = self.blocks.get(key)
            lo = len(found) * self.block_size
            if (block is None or block.parent != parent or block.tokens != tuple(tokens[lo : lo + self.block_size])
                    or (need_features and block.features is None)):
                break
            found.append(block)
            keys.append(key)
            parent = key
        rest = tokens[len(found) * self.block_size : limit]
        best, shared = None, 0
        for key in self.children.get(parent, ()) if rest else ():
            child = self.blocks[key]
            n = _shared_length(child.tokens, rest)
            if n > shared and not (need_features and child.features is None):
                best, shared = key, n
        if best is not None:
            keys.append(best)
            found.append(self.blocks[best].head(shared))
        self._refresh(keys)
        self.queried_tokens += len(tokens)
        self.hit_tokens += sum(len(b.tokens) for b in found)
        return found

    def _insert(self, tokens: list[int], read: BlockReader, has_features: bool) -> int:
        size = self.block_size
        keys = chain_hashes(tokens, size)
        added = 0
        parent = None
        for i, key in enumerate(keys):
            old = self.blocks.get(key)
            if old is not None and old.features is None and has_features:
                self._remove(key)  # replaced below by the same block with its features
            if key not in self.blocks:
                if not self._add(key, parent, tuple(tokens[i * size : (i + 1) * size]), read, i, has_features):
                    self._refresh([key for key in keys if key in self.blocks])
                    return added
                added += 1
            parent = key
        tail = tuple(tokens[len(keys) * size :])
        if tail and not self._covered(parent, tail, has_features):
            key = hash((parent, tail))  # shorter than a whole block: never a whole block's tokens
            if self._add(key, parent, tail, read, len(keys), has_features):  # drops a same-key block it covers
                keys.append(key)
                added += 1
        self._refresh([key for key in keys if key in self.blocks])
        return added

    def _covered(self, parent: int | None, tail: tuple[int, ...], has_features: bool) -> bool:
        """A pooled child of `parent` starts with `tail` (and has features where the new one would)."""
        return any(self.blocks[key].tokens[: len(tail)] == tail
                   and (self.blocks[key].features is not None or not has_features)
                   for key in self.children.get(parent, ()))

    def _add(self, key: int, parent: int | None, tokens: tuple[int, ...], read: BlockReader, i: int,
             has_features: bool) -> bool:
        """Pool one block (whole or partial), dropping the partial siblings it covers; False: it does not fit."""
        for old in [c for c in self.children.get(parent, ()) if len(self.blocks[c].tokens) < self.block_size]:
            block = self.blocks[old]
            if tokens[: len(block.tokens)] == block.tokens and (has_features or block.features is None):
                self._remove(old)
        k, v, features = read(i, len(tokens))
        block = Block(parent, tokens, k, v, features)
        if not self._make_room(block.nbytes):
            return False
        self.blocks[key] = block
        self.children.setdefault(parent, set()).add(key)
        self.bytes_used += block.nbytes
        return True

    def _remove(self, key: int) -> Block:
        block = self.blocks.pop(key)
        self.bytes_used -= block.nbytes
        siblings = self.children.get(block.parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self.children[block.parent]
        return block

    def _refresh(self, keys: list[int]) -> None:
        """Most recently used: the chain's first block last, so tails are evicted before heads."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.max_bytes:
            return False
        while self.bytes_used + nbytes > self.max_bytes:
            self._remove(next(iter(self.blocks)))
        return True
