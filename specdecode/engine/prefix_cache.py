"""The prefix cache: K/V of finished prompt and response prefixes, reused by later requests that start the same.

Blocks of `block_size` tokens are keyed by a chained hash (a block's key hashes its parent's key and its own
tokens, as in vLLM V1), so a key names the whole prefix up to the block's end and a lookup walks the prompt's
blocks until the first miss. Each entry keeps its tokens and parent key, and a match compares them: a hash
collision can only cost a miss, never a wrong reuse. The pool holds copies (the engine's cache is static per
row), bounded in bytes; the least recently used entries go first, and a match refreshes a chain from its
last block to its first so a chain loses its tail before its head (a parent without children stays useful,
a child without its parent is unreachable).

Only committed tokens are inserted (slots below a row's length, never a tree's scratch slots or rejected
drafts), and a hit is copied into the row, so speculation never writes into a pooled block.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_BLOCK_SIZE = 16
DEFAULT_POOL_GB = 1.0


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

    @property
    def nbytes(self) -> int:
        extra = 0 if self.features is None else self.features.numel() * self.features.element_size()
        return 2 * self.k.numel() * self.k.element_size() + extra


BlockReader = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
"""Block index -> copies of its k, v [L, kvh, block, hd] and features [block, F] (or None)."""


class PrefixCache:
    """A bounded LRU pool of K/V blocks keyed by chained block hashes."""

    def __init__(self, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.blocks: OrderedDict[int, Block] = OrderedDict()
        """Oldest first: eviction pops from the front."""
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
        """The longest chain of pooled blocks covering a prefix of tokens[:limit] (counted in the hit rate)."""
        with self._lock:
            return self._match(tokens, limit, need_features)

    def insert(self, tokens: list[int], read: BlockReader, has_features: bool = False) -> int:
        """Pool the full blocks of `tokens` (whose K/V `read` copies out); returns the blocks added. With
        `has_features`, pooled blocks that lack features (pooled by a row whose proposer reads none) get them,
        so a later feature-reading request still matches them."""
        with self._lock:
            return self._insert(tokens, read, has_features)

    def clear(self) -> None:
        with self._lock:
            self.blocks.clear()
            self.bytes_used = 0

    def _match(self, tokens: list[int], limit: int, need_features: bool) -> list[Block]:
        found: list[Block] = []
        parent = None
        for key in chain_hashes(tokens[:limit], self.block_size):
            block = self.blocks.get(key)
            lo = len(found) * self.block_size
            if (block is None or block.parent != parent or block.tokens != tuple(tokens[lo : lo + self.block_size])
                    or (need_features and block.features is None)):
                break
            found.append(block)
            parent = key
        self._refresh(chain_hashes(tokens[: len(found) * self.block_size], self.block_size))
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(found) * self.block_size
        return found

    def _insert(self, tokens: list[int], read: BlockReader, has_features: bool) -> int:
        keys = chain_hashes(tokens, self.block_size)
        added = 0
        parent = None
        for i, key in enumerate(keys):
            old = self.blocks.get(key)
            if old is not None and old.features is None and has_features:
                self.blocks.pop(key)  # replaced below by the same block with its features
                self.bytes_used -= old.nbytes
            if key not in self.blocks:
                k, v, features = read(i)
                block = Block(parent, tuple(tokens[i * self.block_size : (i + 1) * self.block_size]), k, v, features)
                if not self._make_room(block.nbytes):
                    break
                self.blocks[key] = block
                self.bytes_used += block.nbytes
                added += 1
            parent = key
        self._refresh([key for key in keys if key in self.blocks])
        return added

    def _refresh(self, keys: list[int]) -> None:
        """Most recently used: the chain's first block last, so tails are evicted before heads."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.max_bytes:
            return False
        while self.bytes_used + nbytes > self.max_bytes:
            _, old = self.blocks.popitem(last=False)
            self.bytes_used -= old.nbytes
        return True
