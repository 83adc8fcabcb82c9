"""The prefix cache: K/V of finished prompt and response prefixes, reused by later requests that start the same.

Blocks of `block_size` tokens are keyed by chained digests (a block's key digests its parent's key and its own
tokens, as in vLLM V1), so a key names the whole prefix up to the block's end and a lookup walks the prompt's
blocks until the first miss. The digest is BLAKE2b keyed with a random per-process secret: a client cannot
compute a key, so it cannot aim a collision at another request's blocks. Correctness does not rest on the digest
either: each entry keeps its tokens and parent key and both are compared on every match and insert, an insert
never adopts an entry of other tokens, and a block leaves the pool with its descendants, so an entry's parent
key always names the very block it was computed after. A collision can only cost a miss, never a wrong reuse.

A request's optional `cache_salt` picks its namespace: the first blocks' parent is a root key derived from the
salt, so requests with different salts share no block (and cannot probe each other's prompts by timing), and
requests without one share the default namespace.

The pool holds copies (the engine's cache is static per row), bounded in bytes; the least recently used entries
go first, and a match refreshes a chain from its last block to its first so a chain loses its tail before its
head. Reuse is token-exact, as in a radix tree: after the last whole block, a prompt takes the longest run of
tokens it shares with any pooled child of that block (a block it leaves midway, or a row's last, partial block,
which is pooled too, so a conversation's next turn reuses the whole previous one). A partial block is replaced by
a longer one, or by the whole block, that covers it.

Only committed tokens are inserted (slots below a row's length, never a tree's scratch slots or rejected
drafts), and a hit is copied into the row, so speculation never writes into a pooled block.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdecode.model.kv_cache import KVCache

DEFAULT_BLOCK_SIZE = 16
KEY_BYTES = 16

_PROCESS_KEY = secrets.token_bytes(32)
"""Keys every digest (BLAKE2b's MAC mode), fresh per process: keys are unpredictable from outside."""
_BLOCK_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, key=_PROCESS_KEY, person=b"block")
"""Copied per block: cheaper than keying a new hasher each time."""


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block of `tokens` (whole or partial) after the prefix that the key `parent` names."""
    h = _BLOCK_HASHER.copy()
    h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def root_key(salt: str | None = None) -> bytes:
    """The parent key of a namespace's first blocks: the shared one (no salt) or a request's `cache_salt`'s.
    One byte longer than a block key, so a root never equals a block's key."""
    data = b"" if salt is None else b"\x01" + salt.encode("utf-8", "surrogatepass")
    return b"r" + hashlib.blake2b(data, digest_size=KEY_BYTES, key=_PROCESS_KEY, person=b"root").digest()


def chain_keys(tokens: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """Chained keys of the full blocks of `tokens`: key i names tokens [0, (i + 1) * block_size)."""
    keys: list[bytes] = []
    parent = root_key(salt)
    for i in range(len(tokens) // block_size):
        parent = block_digest(parent, tokens[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys


@dataclass
class Block:
    parent: bytes
    """The key of the prefix the block follows (its namespace's root key for a first block)."""
    tokens: tuple[int, ...]
    k: torch.Tensor  # [L, kvh, block, hd]
    v: torch.Tensor  # [L, kvh, block, hd]
    features: torch.Tensor | None = None
    """The target's features of the block's positions [block, F] for proposers that read them (EAGLE)."""

    def follows(self, parent: bytes, tokens: tuple[int, ...]) -> bool:
        """The block holds `tokens` right after the prefix `parent` names (what its key claims)."""
        return self.parent == parent and self.tokens == tokens

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
    """A bounded LRU pool of K/V blocks keyed by chained block digests."""

    def __init__(self, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        """Oldest first: eviction pops from the front."""
        self.children: dict[bytes, set[bytes]] = {}
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

    def match(self, tokens: list[int], limit: int, need_features: bool = False, salt: str | None = None,
              ) -> list[Block]:
        """The pooled blocks covering the longest prefix of tokens[:limit] in the namespace of `salt` (counted in
        the hit rate): whole blocks, then at most one block trimmed to the tokens it shares (a view)."""
        with self._lock:
            return self._match(tokens, limit, need_features, root_key(salt))

    def insert(self, tokens: list[int], read: BlockReader, has_features: bool = False, salt: str | None = None,
               ) -> int:
        """Pool the blocks of `tokens` in the namespace of `salt`, the last partial one included (`read` copies
        their K/V out); returns the blocks added. With `has_features`, pooled blocks that lack features (pooled by
        a row whose proposer reads none) get them, so a later feature-reading request still matches them."""
        with self._lock:
            return self._insert(tokens, read, has_features, root_key(salt))

    def restore(self, cache: KVCache, row: int, tokens: list[int], limit: int, need_features: bool = False,
                salt: str | None = None) -> tuple[int, torch.Tensor | None]:
        """Copy the pooled K/V of the longest prefix of tokens[:limit] into `row` of `cache` from slot 0; returns
        the tokens restored and, with `need_features`, their features [n, F] (None when nothing matched)."""
        blocks = self.match(tokens, limit, need_features, salt)
        n = 0
        for block in blocks:
            cache.write_span(row, n, block.k, block.v)
            n += len(block.tokens)
        features = torch.cat([b.features for b in blocks]) if blocks and need_features else None  # type: ignore[misc]
        return n, features

    def remember(self, cache: KVCache, row: int, tokens: list[int], features: torch.Tensor | None,
                 salt: str | None = None) -> int:
        """Pool the committed tokens of `row` of `cache` (`tokens`, cut to the row's length: a stop inside an
        accepted block keeps fewer tokens than slots, and slots past the length hold scratch) with their
        features [>= n, F] where given, in the namespace of `salt`; returns the blocks added."""
        n = min(cache.lengths[row], len(tokens))
        size = self.block_size

        def read(i: int, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            k, v = cache.read_span(row, i * size, m)
            return k, v, None if features is None else features[i * size : i * size + m].clone()

        return self.insert(tokens[:n], read, has_features=features is not None, salt=salt)

    def clear(self) -> None:
        with self._lock:
            self.blocks.clear()
            self.children.clear()
            self.bytes_used = 0

    def _match(self, tokens: list[int], limit: int, need_features: bool, parent: bytes) -> list[Block]:
        size, limit = self.block_size, min(limit, len(tokens))
        found: list[Block] = []
        keys: list[bytes] = []  # the matched blocks' keys
        while (len(found) + 1) * size <= limit:  # keys are computed only up to the first miss
            lo = len(found) * size
            chunk = tuple(tokens[lo : lo + size])
            key = block_digest(parent, chunk)
            block = self.blocks.get(key)
            if block is None or not block.follows(parent, chunk) or (need_features and block.features is None):
                break
            found.append(block)
            keys.append(key)
            parent = key
        rest = tokens[len(found) * size : limit]
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

    def _insert(self, tokens: list[int], read: BlockReader, has_features: bool, parent: bytes) -> int:
        size = self.block_size
        chain: list[bytes] = []  # keys of the blocks of `tokens` pooled so far: kept while the rest is added
        added = 0
        for i in range(len(tokens) // size):
            chunk = tuple(tokens[i * size : (i + 1) * size])
            key = block_digest(parent, chunk)
            old = self.blocks.get(key)
            if old is None:
                if not self._add(key, parent, chunk, read, i, has_features, chain):
                    break
                added += 1
            elif not old.follows(parent, chunk):  # a key collision: never adopt K/V of other tokens
                break
            elif old.features is None and has_features and not self._add_features(key, read, i, chain):
                break
            chain.append(key)
            parent = key
        else:
            tail = tuple(tokens[len(chain) * size :])
            if tail and not self._covered(parent, tail, has_features):
                key = block_digest(parent, tail)  # shorter than a whole block: never a whole block's tokens
                if self._add(key, parent, tail, read, len(chain), has_features, chain):  # drops blocks it covers
                    chain.append(key)
                    added += 1
        self._refresh(chain)
        return added

    def _covered(self, parent: bytes, tail: tuple[int, ...], has_features: bool) -> bool:
        """A pooled child of `parent` starts with `tail` (and has features where the new one would)."""
        return any(self.blocks[key].tokens[: len(tail)] == tail
                   and (self.blocks[key].features is not None or not has_features)
                   for key in self.children.get(parent, ()))

    def _add(self, key: bytes, parent: bytes, tokens: tuple[int, ...], read: BlockReader, i: int,
             has_features: bool, keep: list[bytes]) -> bool:
        """Pool one block (whole or partial) after `parent`, dropping the partial siblings it covers, and
        evicting anything but `keep` (its ancestors) to fit; False: it does not fit, or its key is taken."""
        for old in [c for c in self.children.get(parent, ()) if len(self.blocks[c].tokens) < self.block_size]:
            block = self.blocks[old]
            if tokens[: len(block.tokens)] == block.tokens and (has_features or block.features is None):
                self._remove(old)
        if key in self.blocks:  # a collision with a block of other tokens or another parent
            return False
        k, v, features = read(i, len(tokens))
        block = Block(parent, tokens, k, v, features)
        if not self._make_room(block.nbytes, keep):
            return False
        self.blocks[key] = block
        self.children.setdefault(parent, set()).add(key)
        self.bytes_used += block.nbytes
        return True

    def _add_features(self, key: bytes, read: BlockReader, i: int, keep: list[bytes]) -> bool:
        """Replace a pooled block by a copy with its features, in place (same LRU slot, same children)."""
        old = self.blocks[key]
        k, v, features = read(i, len(old.tokens))
        new = Block(old.parent, old.tokens, k, v, features)
        if not self._make_room(new.nbytes - old.nbytes, [*keep, key]):
            return False
        self.blocks[key] = new
        self.bytes_used += new.nbytes - old.nbytes
        return True

    def _remove(self, key: bytes) -> None:
        """Drop a block and its descendants: they are unreachable without it, and a block pooled later under
        the same key must never pass for their parent."""
        stack = [key]
        while stack:
            key = stack.pop()
            block = self.blocks.pop(key)
            self.bytes_used -= block.nbytes
            siblings = self.children.get(block.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self.children[block.parent]
            stack.extend(self.children.pop(key, ()))

    def _refresh(self, keys: list[bytes]) -> None:
        """Most recently used: the chain's first block last, so tails are evicted before heads."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def _make_room(self, nbytes: int, keep: list[bytes]) -> bool:
        """Evict the least recently used blocks but `keep` (and their descendants) until nbytes more fit."""
        if nbytes > self.max_bytes:
            return False
        kept = set(keep)
        while self.bytes_used + nbytes > self.max_bytes:
            victim = next((key for key in self.blocks if key not in kept), None)
            if victim is None:
                return False
            self._remove(victim)
        return True
