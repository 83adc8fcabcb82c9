"""The prefix cache's pool on its own: chained block keys, longest-chain match, LRU eviction tail first, the bound
(tests/test_prefix_keys.py: keys that cannot be forged, cache salts)."""

from __future__ import annotations

import torch

from specdecode.engine.prefix_cache import PrefixCache, chain_keys

BLOCK = 4


def _reader(tag: float, features: bool = False):  # noqa: ANN202
    """K/V of n slots of block i [L=1, kvh=1, n, hd=2] filled with tag + i (to see which copy was pooled)."""
    def read(i: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k = torch.full((1, 1, n, 2), tag + i)
        return k, k.clone(), torch.full((n, 3), tag + i) if features else None
    return read


BLOCK_BYTES = 2 * 1 * 1 * BLOCK * 2 * 4  # k and v, fp32


def test_chain_keys_name_whole_prefixes() -> None:
    a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    b = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    c = chain_keys([0, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert len(a) == 2 and a == b  # only full blocks
    assert c[1] != a[1]  # same second block, different first: a different prefix


def _spans(blocks) -> list[tuple[float, int]]:  # noqa: ANN001
    """(tag of the pooled copy, tokens used) of each matched block."""
    return [(float(b.k[0, 0, 0, 0]), len(b.tokens)) for b in blocks]


def test_match_finds_the_longest_pooled_prefix() -> None:
    pool = PrefixCache(1 << 20, BLOCK)
    tokens = list(range(12))
    assert pool.insert(tokens, _reader(0.0)) == 3
    assert pool.insert(tokens[:8], _reader(9.0)) == 0  # already pooled: nothing copied
    got = pool.match([*tokens[:8], 99, 100, 101, 102, 103], limit=12)
    assert _spans(got) == [(0.0, 4), (1.0, 4)]
    assert _spans(pool.match(tokens, limit=11)) == [(0.0, 4), (1.0, 4), (2.0, 3)]  # the limit cuts block 3
    assert pool.match([5, *tokens[1:]], limit=12) == []
    assert pool.hit_tokens == 8 + 11 + 0 and pool.queried_tokens == 13 + 12 + 12


def test_a_prompt_reuses_the_shared_part_of_a_block() -> None:
    """Reuse is token-exact: a prompt that leaves a pooled block midway keeps the tokens it shares with it."""
    pool = PrefixCache(1 << 20, BLOCK)
    pool.insert(list(range(8)), _reader(0.0))
    got = pool.match([0, 1, 2, 3, 4, 5, 77, 78, 79], limit=9)
    assert _spans(got) == [(0.0, 4), (1.0, 2)]
    assert got[1].k.shape[2] == 2 and got[1].tokens == (4, 5)
    assert pool.hit_tokens == 6


def test_a_finished_rows_last_partial_block_is_pooled() -> None:
    """A conversation's next turn starts with the whole previous one: its last, partial block is pooled too, and
    a longer tail that covers it replaces it."""
    pool = PrefixCache(1 << 20, BLOCK)
    assert pool.insert(list(range(6)), _reader(0.0)) == 2  # one full block, one of 2 tokens
    assert _spans(pool.match([*range(6), 50, 51], limit=8)) == [(0.0, 4), (1.0, 2)]
    assert pool.insert(list(range(5)), _reader(5.0)) == 0  # covered by the pooled tail
    assert pool.insert(list(range(7)), _reader(7.0)) == 1  # a longer tail replaces the shorter
    assert len(pool.blocks) == 2
    assert pool.insert(list(range(8)), _reader(8.0)) == 1  # the full block replaces it
    assert len(pool.blocks) == 2 and pool.bytes_used == 2 * BLOCK_BYTES
    assert _spans(pool.match(list(range(9)), limit=9)) == [(0.0, 4), (9.0, 4)]


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
    pool.insert(list(range(10)), _reader(0.0))
    assert len(pool.match(list(range(10)), 10, need_features=True)) == 2  # the tail without features is not used
    pool.insert(list(range(10)), _reader(5.0, features=True), has_features=True)
    assert len(pool.match(list(range(10)), 10, need_features=True)) == 3
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
