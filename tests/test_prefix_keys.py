"""The prefix cache's keys cannot be forged: keyed digests, and no wrong reuse even when the digest collides
(forced here by weak or constant digests); `cache_salt` namespaces share nothing, equal salts share."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence

import pytest
import torch

from specdecode.engine import prefix_cache
from specdecode.engine.prefix_cache import KEY_BYTES, PrefixCache, block_digest, chain_keys, root_key

BLOCK = 4
BLOCK_BYTES = 2 * 1 * 1 * BLOCK * 2 * 4  # k and v of one block, fp32

Digest = Callable[[bytes, Sequence[int]], bytes]


def _constant(parent: bytes, tokens: Sequence[int]) -> bytes:
    return bytes(KEY_BYTES)


def _tokens_only(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Ignores the parent: the same block after different prefixes collides."""
    return hashlib.blake2b(bytes(tokens), digest_size=KEY_BYTES).digest()


def _sorted(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Any permutation of a block collides, after colliding parents too."""
    return hashlib.blake2b(parent + bytes(sorted(tokens)), digest_size=KEY_BYTES).digest()


def _sum(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Collides whenever parents are equal and token sums agree."""
    return hashlib.blake2b(parent + bytes([sum(tokens) % 7]), digest_size=KEY_BYTES).digest()


WEAK: dict[str, Digest] = {"constant": _constant, "tokens-only": _tokens_only, "sorted": _sorted, "sum": _sum}


def _reader(prompt_id: int) -> prefix_cache.BlockReader:
    """K/V of block i of prompt `prompt_id`: k holds the prompt's id, v the block's index (to trace every
    matched block back to the prompt whose forward computed it)."""
    def read(i: int, n: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        return torch.full((1, 1, n, 2), float(prompt_id)), torch.full((1, 1, n, 2), float(i)), None
    return read


def _assert_honest(blocks: list[prefix_cache.Block], tokens: list[int], prompts: list[list[int]]) -> None:
    """Each matched block was computed by a prompt that starts with exactly the tokens matched up to its end."""
    at = 0
    for b in blocks:
        source, index = int(b.k[0, 0, 0, 0]), int(b.v[0, 0, 0, 0])
        end = at + len(b.tokens)
        assert index * BLOCK == at, "a block used at another position than it was computed at"
        assert prompts[source][:end] == tokens[:end], "K/V computed after other tokens was reused"
        at = end


def test_keys_are_keyed_digests() -> None:
    a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert [len(k) for k in a] == [KEY_BYTES] * 2
    # Not a plain digest anyone could compute: keyed with the process's secret.
    plain = hashlib.blake2b(root_key() + bytes(8 * BLOCK), digest_size=KEY_BYTES).digest()
    assert block_digest(root_key(), [0] * BLOCK) != plain
    salted = [chain_keys([1, 2, 3, 4], BLOCK, salt=salt) for salt in ("a", "b", "a")]
    assert salted[0] != a[:1] and salted[0] != salted[1] and salted[0] == salted[2]
    assert root_key(None) != root_key("") and len(root_key("x")) != KEY_BYTES  # a root is never a block's key


@pytest.mark.parametrize("weak", list(WEAK))
def test_a_colliding_key_is_never_adopted(weak: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache, "block_digest", WEAK[weak])
    pool = PrefixCache(1 << 20, BLOCK)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 3, 2, 1, 5, 6, 7, 8, 9], [9, 9, 9, 9, 5, 6, 7, 8]]
    for i, p in enumerate(prompts):
        pool.insert(p, _reader(i))
    for p in prompts:
        _assert_honest(pool.match(p, len(p)), p, prompts)
    whole = 1 if weak == "constant" else 3  # every key one: only the first block has its key
    assert _spans_of(pool.match(prompts[0], 9)) == [0] * whole  # the first prompt, stored first, stays
    assert pool.bytes_used == sum(b.nbytes for b in pool.blocks.values())


def _spans_of(blocks: list[prefix_cache.Block]) -> list[int]:
    return [int(b.k[0, 0, 0, 0]) for b in blocks]


@pytest.mark.parametrize("weak", ["sorted", "sum", "tokens-only"])
def test_an_evicted_parents_children_leave_with_it(weak: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child must never outlive its parent: a colliding block pooled later under the parent's key would
    otherwise pass for it, and the child's K/V (computed after the old parent's tokens) would be reused."""
    monkeypatch.setattr(prefix_cache, "block_digest", WEAK[weak])
    pool = PrefixCache(1 << 20, BLOCK)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [4, 3, 2, 1, 5, 6, 7, 8]  # a permutation of a's first block (colliding under "sorted" and "sum")
    pool.insert(a, _reader(0))
    head = chain_keys(a, BLOCK)[0]
    pool._remove(head)  # as eviction does
    assert not pool.blocks and not pool.children and pool.bytes_used == 0
    pool.insert(b[:4], _reader(1))
    _assert_honest(pool.match(b, 8), b, [a, b])
    assert len(pool.match(b, 8)) == 1


@pytest.mark.parametrize("weak", [None, *WEAK])
def test_random_traffic_never_reuses_kv_of_other_tokens(weak: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts over a 3-token alphabet (many shared prefixes, many permuted blocks), a pool of 6 blocks that
    evicts all the time, features on some inserts: every match is honest, and the accounting stays exact."""
    if weak is not None:
        monkeypatch.setattr(prefix_cache, "block_digest", WEAK[weak])
    rng = random.Random(7)
    pool = PrefixCache(6 * BLOCK_BYTES, BLOCK)
    prompts: list[list[int]] = []
    hits = 0
    for step in range(400):
        if prompts and rng.random() < 0.5:
            base = rng.choice(prompts)
            tokens = base[: rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        else:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 17))]
        got = pool.match(tokens, len(tokens))
        _assert_honest(got, tokens, prompts)
        hits += len(got)
        prompts.append(tokens)
        pool.insert(tokens, _reader(len(prompts) - 1))
        assert pool.bytes_used == sum(b.nbytes for b in pool.blocks.values()) <= pool.max_bytes
        assert all(pool.blocks[k].parent == p for p, kids in pool.children.items() for k in kids)
        assert all(b.parent in pool.blocks or len(b.parent) != KEY_BYTES for b in pool.blocks.values()), step
    assert hits > 0


def test_different_salts_never_share_blocks_and_equal_salts_do() -> None:
    pool = PrefixCache(1 << 20, BLOCK)
    tokens = list(range(10))
    assert pool.insert(tokens, _reader(0), salt="tenant-a") == 3
    assert pool.match(tokens, 10, salt="tenant-b") == []
    assert pool.match(tokens, 10) == []  # no salt: the shared namespace
    assert [len(b.tokens) for b in pool.match(tokens, 10, salt="tenant-a")] == [4, 4, 2]
    assert pool.insert(tokens, _reader(1), salt="tenant-b") == 3  # its own copy, not tenant a's
    assert _spans_of(pool.match(tokens, 10, salt="tenant-b")) == [1, 1, 1]
    assert _spans_of(pool.match(tokens, 10, salt="tenant-a")) == [0, 0, 0]
    assert pool.insert(tokens, _reader(2)) == 3
    assert _spans_of(pool.match(tokens, 10)) == [2, 2, 2]
    assert len(pool.blocks) == 9


def test_salted_namespaces_hold_under_a_constant_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Salts are kept apart by the roots the blocks hang off, which a match compares, not by digest luck."""
    monkeypatch.setattr(prefix_cache, "block_digest", _constant)
    pool = PrefixCache(1 << 20, BLOCK)
    pool.insert([1, 2, 3, 4], _reader(0), salt="a")
    assert pool.match([1, 2, 3, 4, 5], 5, salt="b") == [] and pool.match([1, 2, 3, 4, 5], 5) == []
    assert _spans_of(pool.match([1, 2, 3, 4, 5], 5, salt="a")) == [0]
