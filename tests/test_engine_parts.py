"""The engine's small parts on their own: the catch-up charge, a lone row's cost model, the chunk timer, the
prefill shares of sibling choices, and the prefix pool's restore into and remember from a KV cache."""

from __future__ import annotations

import pytest
import torch

from specdecode.cost_model import CostModel
from specdecode.engine.adaptive import AdaptiveK
from specdecode.engine.chunking import MIN_CHUNK_TOKENS, ChunkTimer
from specdecode.engine.prefill_share import PrefillShares
from specdecode.engine.prefix_cache import PrefixCache
from specdecode.engine.running import Running
from specdecode.engine.schedule import CATCH_UP_HORIZON_TOKENS, catch_up_share, row_cost
from specdecode.model.kv_cache import KVCache


def test_the_catch_up_is_spread_over_the_steps_left_unless_the_load_dips() -> None:
    assert catch_up_share(0, 0.01, 100, 2.0, dip=False) == 0.0
    assert catch_up_share(50, 0.01, 100, 2.0, dip=False) == pytest.approx(0.5 / 50)  # 100 tokens at 2 per step
    assert catch_up_share(50, 0.01, 100, 2.0, dip=True) == pytest.approx(0.5)  # all of it now
    far = catch_up_share(50, 0.01, 10_000, 1.0, dip=False)
    assert far == pytest.approx(0.5 / CATCH_UP_HORIZON_TOKENS)  # max_tokens is only a bound
    assert catch_up_share(50, 0.01, 1, 4.0, dip=False) == pytest.approx(0.5)  # never over less than one step


def test_a_lone_tree_row_prices_the_nodes_its_budget_affords() -> None:
    cost = CostModel.from_points({1: 0.1, 8: 0.1, 64: 0.4}, 64)
    assert row_cost(cost, 1, 4) is cost  # a chain verifies k nodes at depth k
    tree = row_cost(cost, 4, 4)
    assert len(tree.tree_nodes) == 4
    assert all(nodes >= depth for depth, nodes in enumerate(tree.tree_nodes, 1))  # branches at every depth
    assert tree.tree_nodes[-1] > 4
    assert tree.step_seconds(4) >= cost.step_seconds(4)


def test_the_chunk_timer_sizes_by_measured_time_and_skips_tiny_chunks() -> None:
    timer = ChunkTimer()
    assert timer.budget(256) == MIN_CHUNK_TOKENS  # nothing measured yet
    timer.chunk_ran(MIN_CHUNK_TOKENS - 1, 10.0)  # mostly the forward's fixed part: not measured
    assert timer.token_seconds is None
    timer.chunk_ran(100, 0.5)
    timer.decode_ran(0.2)
    assert timer.budget(256) == 60  # 1.5 decode steps of 0.2 s at 5 ms per token
    assert timer.budget(40) == 40


def _running(group: object | None) -> Running:
    class Seq:
        prefill_group = group
    return Running(Seq(), 0, AdaptiveK(fixed_k=0))  # type: ignore[arg-type]


def test_a_shared_prefill_lasts_until_the_last_sibling_or_its_source_goes() -> None:
    group = object()
    shares = PrefillShares()
    source, sibling, last = _running(group), _running(group), _running(group)
    shares.offer(_running(None), torch.zeros(1, 4))  # no group: nothing to share
    assert len(shares) == 0
    shares.offer(source, torch.ones(1, 4))
    done = shares.take(sibling.seq, next_waiting=last.seq)  # another sibling waits: kept
    assert done is not None and done.source is source and len(shares) == 1
    assert shares.take(last.seq, next_waiting=_running(object()).seq) is done  # the last one: gone
    assert len(shares) == 0
    shares.offer(source, torch.ones(1, 4))
    shares.forget(_running(group))  # another row of the group: not its source
    assert len(shares) == 1
    shares.forget(source)
    assert len(shares) == 0 and shares.take(sibling.seq, None) is None


def test_the_pool_restores_into_a_row_what_it_remembered_from_another() -> None:
    cache = KVCache(num_layers=2, batch_size=2, num_kv_heads=1, max_len=32, head_dim=3, dtype=torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    tokens = list(range(10))
    cache.set_length(0, 9)  # a stop inside the last accepted block: 9 slots hold committed tokens
    features = torch.randn(32, 5)
    pool = PrefixCache(1 << 20, block_size=4)
    assert pool.remember(cache, 0, tokens, features) == 3  # two whole blocks and a partial one
    n, restored = pool.restore(cache, 1, tokens, limit=9, need_features=True)
    assert n == 9
    assert torch.equal(cache.k[:, 1, :, :9], cache.k[:, 0, :, :9])
    assert torch.equal(cache.v[:, 1, :, :9], cache.v[:, 0, :, :9])
    assert restored is not None and torch.equal(restored, features[:9])
    assert pool.restore(cache, 1, tokens, limit=10)[0] == 9  # the slot past the row's length was not pooled
    assert pool.restore(cache, 1, [99, *tokens], limit=10, need_features=False) == (0, None)
