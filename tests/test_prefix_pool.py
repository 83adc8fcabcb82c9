"""The prefix cache's pool on its own: chained block keys, longest-chain match, LRU eviction tail first, the bound."""

from __future__ import annotations

import torch

from specdecode.engine.prefix_cache import PrefixCache, chain_hashes

BLOCK = 4


def _reader(tag: float, features: bool = False):  # noqa: ANN202
    """K/V blocks [L=1, kvh=1, BLOCK, hd=2] filled with tag + block index (to see which copy was pooled)."""
    def read(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k = torch.full((1, 1, BLOCK, 2), tag + i)
        return k, k.clone(), torch.full((BLOCK, 3), tag + i) if features else None
    return read


BLOCK_BYTES = 2 * 1 * 1 * BLOCK * 2 * 4  # k and v, fp32


def test_chain_hashes_name_whole_prefixes() -> None:
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    c = chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert len(a) == 2 and a == b  # only full blocks
    assert c[1] != a[1]  # same second block, different first: a different prefix


def test_match_finds_the_longest_pooled_prefix() -> None:
    pool = PrefixCache(1 << 20, BLOCK)
    tokens = list(range(12))
    assert pool.insert(tokens, _reader(0.0)) == 3
    assert pool.insert(tokens[:8], _reader(9.0)) == 0  # already pooled: nothing copied
    got = pool.match([*tokens[:8], 99, 100, 101, 102, 103], limit=12)
    assert [float(b.k[0, 0, 0, 0]) for b in got] == [0.0, 1.0]
    assert len(pool.match(tokens, limit=11)) == 2  # the limit cuts block 3
    assert pool.match([5, *tokens[1:]], limit=12) == []
    assert pool.hit_tokens == 8 + 8 + 0 and pool.queried_tokens == 13 + 12 + 12


def test_features_are_required_only_when_asked() -> None:
    pool = PrefixCache(1 << 20, BLOCK)
    pool.insert(list(range(8)), _reader(0.0))
    assert len(pool.match(list(range(8)), 8)) == 2
    assert pool.match(list(range(8)), 8, need_features=True) == []
    pool.insert(list(range(100, 108)), _reader(0.0, features=True))
    assert len(pool.match(list(range(100, 108)), 8, need_features=True)) == 2


def test_a_row_with_features_completes_blocks_pooled_without() -> None:
    """A plain request pools a prompt first; a head-drafting request with the same prompt must still find it
    later, once a feature-carrying row has pooled it again (else every such request misses for good)."""
    pool = PrefixCache(1 << 20, BLOCK)
    pool.insert(list(range(8)), _reader(0.0))
    assert pool.insert(list(range(8)), _reader(5.0)) == 0  # no features to add: nothing copied
    pool.insert(list(range(8)), _reader(5.0, features=True), has_features=True)
    got = pool.match(list(range(8)), 8, need_features=True)
    assert [float(b.features[0, 0]) for b in got] == [5.0, 6.0]  # type: ignore[index]
    assert pool.bytes_used == sum(b.nbytes for b in pool.blocks.values())


def test_eviction_is_lru_tails_first_and_bounded() -> None:
    pool = PrefixCache(3 * BLOCK_BYTES, BLOCK)
    pool.insert(list(range(12)), _reader(0.0))  # blocks a0 a1 a2
    assert pool.bytes_used == 3 * BLOCK_BYTES
    pool.insert([50, 51, 52, 53], _reader(10.0))  # one more block: a chain's tail goes, its head stays
    assert pool.bytes_used <= pool.max_bytes
    assert len(pool.match(list(range(12)), 12)) == 2
    pool.insert(list(range(60, 68)), _reader(20.0))  # two blocks: the oldest entries go first
    assert pool.bytes_used <= pool.max_bytes and len(pool.blocks) == 3
    assert len(pool.match(list(range(60, 68)), 8)) == 2


def test_a_block_larger_than_the_pool_is_not_kept() -> None:
    pool = PrefixCache(BLOCK_BYTES - 1, BLOCK)
    assert pool.insert(list(range(8)), _reader(0.0)) == 0
    assert pool.bytes_used == 0 and pool.match(list(range(8)), 8) == []
