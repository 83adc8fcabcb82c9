"""The static KV cache: slot writes, truncate-and-continue, tree forwards, compaction, batches.

Every model-level check compares against a fresh plain-chain forward over the same tokens, in fp32
on tiny random Llama and Qwen2 checkpoints, at a tight tolerance.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.model.kv_cache import KVCache
from specdecode.model.load import LoadedModel, load_model

TOL = 1e-4  # fp32 summation-order noise is up to ~2e-5 (logits O(5)); a wrong or stale K/V entry gives O(0.1)



@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request: pytest.FixtureRequest) -> LoadedModel:
    path = request.getfixturevalue("tiny_llama_dir" if request.param == "llama" else "tiny_qwen_dir")
    return load_model(str(path), "fp32", "cpu")


def _tokens(lm: LoadedModel, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, lm.config.vocab_size, (n,), generator=gen).tolist()


def _forward(lm: LoadedModel, cache: KVCache, tokens: list[int], start: int, **kw) -> torch.Tensor:
    """Chain forward of `tokens` at positions start..; fp32 logits [T, V]."""
    toks = torch.tensor([tokens])
    pos = torch.arange(start, start + len(tokens)).unsqueeze(0)
    return lm.model.compute_logits(lm.model(toks, pos, cache, **kw))[0]


def _fresh(lm: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """Logits of every position of a plain prefill over `tokens` in a new cache."""
    return _forward(lm, lm.model.new_cache(1, 64), tokens, 0)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


# ---- the cache object alone ------------------------------------------------------------------------


def _kv(values: list[float]) -> torch.Tensor:
    """[1, 1, T, 1] tensor holding `values` (one kv head, head_dim 1)."""
    return torch.tensor(values).view(1, 1, -1, 1)


def test_write_scattered_slots_single_row() -> None:
    cache = KVCache(num_layers=2, batch_size=1, num_kv_heads=1, max_len=8, head_dim=1, dtype=torch.float32)
    # Same end points as the contiguous run [3, 4, 5, 6] but another order: must scatter, not slice.
    cache.write(1, torch.tensor([[3, 5, 4, 6]]), _kv([10.0, 20.0, 30.0, 40.0]), _kv([1.0, 2.0, 3.0, 4.0]))
    assert cache.k[1, 0, 0, :, 0].tolist() == [0, 0, 0, 10, 30, 20, 40, 0]
    assert cache.v[1, 0, 0, :, 0].tolist() == [0, 0, 0, 1, 3, 2, 4, 0]
    assert cache.k[0].abs().sum() == 0  # other layers untouched
    # A contiguous write and a gap write.
    cache.write(1, torch.tensor([[0, 1]]), _kv([7.0, 8.0]), _kv([7.0, 8.0]))
    cache.write(1, torch.tensor([[2, 7]]), _kv([5.0, 6.0]), _kv([5.0, 6.0]))
    assert cache.k[1, 0, 0, :, 0].tolist() == [7, 8, 5, 10, 30, 20, 40, 6]
    k, v = cache.read(1, 4)
    assert k.shape == v.shape == (1, 1, 4, 1)
    assert k[0, 0, :, 0].tolist() == [7, 8, 5, 10]


def test_write_batch_rows_at_their_own_slots() -> None:
    cache = KVCache(num_layers=1, batch_size=2, num_kv_heads=2, max_len=6, head_dim=3, dtype=torch.float32)
    k = torch.arange(2 * 2 * 2 * 3, dtype=torch.float32).view(2, 2, 2, 3)  # [B, kvh, T, hd]
    slots = torch.tensor([[1, 2], [4, 0]])
    cache.write(0, slots, k, -k)
    for b in range(2):
        for t in range(2):
            assert torch.equal(cache.k[0, b, :, slots[b, t]], k[b, :, t])
            assert torch.equal(cache.v[0, b, :, slots[b, t]], -k[b, :, t])
    assert cache.k[0, 0, :, [0, 3, 4, 5]].abs().sum() == 0
    assert cache.k[0, 1, :, [1, 2, 3, 5]].abs().sum() == 0


def test_lengths_truncate_reset() -> None:
    cache = KVCache(num_layers=1, batch_size=2, num_kv_heads=1, max_len=10, head_dim=2, dtype=torch.float32)
    assert cache.lengths == [0, 0] and cache.batch_size == 2
    assert cache.nbytes() == 2 * 1 * 2 * 1 * 10 * 2 * 4
    cache.set_length(0, 7)
    cache.set_length(1, 10)
    with pytest.raises(ValueError, match="outside"):
        cache.set_length(0, 11)
    with pytest.raises(ValueError, match="outside"):
        cache.set_length(0, -1)
    cache.truncate(4)  # row 0
    assert cache.lengths == [4, 10]
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(5)  # truncation never grows a row
    cache.truncate(2, row=1)
    assert cache.lengths == [4, 2]
    cache.reset(1)
    assert cache.lengths == [4, 0]
    cache.reset()
    assert cache.lengths == [0, 0]


def test_compact_moves_entries_all_layers() -> None:
    cache = KVCache(num_layers=3, batch_size=2, num_kv_heads=2, max_len=8, head_dim=2, dtype=torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    k0, v0 = cache.k.clone(), cache.v.clone()
    cache.compact(1, [6, 4], 3)  # overlapping source and destination ranges
    assert torch.equal(cache.k[:, 1, :, 3], k0[:, 1, :, 6]) and torch.equal(cache.k[:, 1, :, 4], k0[:, 1, :, 4])
    assert torch.equal(cache.v[:, 1, :, 3], v0[:, 1, :, 6]) and torch.equal(cache.v[:, 1, :, 4], v0[:, 1, :, 4])
    untouched = [0, 1, 2, 5, 6, 7]
    assert torch.equal(cache.k[:, 1, :, untouched], k0[:, 1, :, untouched])
    assert torch.equal(cache.k[:, 0], k0[:, 0]) and torch.equal(cache.v[:, 0], v0[:, 0])  # other row
    cache.compact(0, [], 2)  # nothing accepted: a no-op
    assert torch.equal(cache.k[:, 0], k0[:, 0])


# ---- the cache inside a model forward --------------------------------------------------------------


def test_truncate_then_continue_equals_fresh_run(lm: LoadedModel) -> None:
    prompt, draft = _tokens(lm, 10, seed=1), _tokens(lm, 4, seed=2)
    cache = lm.model.new_cache(1, 64)
    _forward(lm, cache, prompt, 0)
    cache.set_length(0, 10)
    _forward(lm, cache, draft, 10)  # a verify pass over 4 draft tokens
    cache.set_length(0, 14)
    cache.truncate(12)  # 2 accepted; slots 12, 13 keep stale K/V that must never be read
    assert cache.lengths[0] == 12

    recovered = _tokens(lm, 1, seed=3)
    got = _forward(lm, cache, recovered, 12)
    cache.set_length(0, 13)
    want = _fresh(lm, prompt + draft[:2] + recovered)
    assert _maxdiff(got[-1], want[-1]) < TOL

    # Continue with a multi-token chunk that covers the stale slot 13 and beyond.
    more = _tokens(lm, 3, seed=4)
    got = _forward(lm, cache, more, 13)
    want = _fresh(lm, prompt + draft[:2] + recovered + more)
    assert _maxdiff(got, want[-3:]) < TOL

    # Truncating everything back to the prompt and re-running gives the original prefill.
    cache.set_length(0, 16)
    cache.truncate(10)
    got = _forward(lm, cache, draft, 10)
    assert _maxdiff(got, _fresh(lm, prompt + draft)[-4:]) < TOL


def _two_branch_tree(lm: LoadedModel, prefix_len: int):
    """Branches A = (a0 -> a1) and B = (b0 -> b1) after the prefix, at slots L..L+3."""
    a, b = _tokens(lm, 2, seed=10), _tokens(lm, 2, seed=11)
    if a[0] == b[0]:
        b[0] = (b[0] + 1) % lm.config.vocab_size
    L = prefix_len
    tokens = torch.tensor([a + b])
    positions = torch.tensor([[L, L + 1, L, L + 1]])
    slots = torch.arange(L, L + 4).unsqueeze(0)
    mask = torch.zeros(1, 4, L + 4, dtype=torch.bool)
    mask[:, :, :L] = True  # everyone sees the prefix
    for node, ancestors in enumerate([[], [0], [], [2]]):
        for j in [*ancestors, node]:
            mask[0, node, L + j] = True
    return a, b, tokens, positions, slots, mask


def test_tree_forward_equals_chain_per_branch(lm: LoadedModel) -> None:
    prefix = _tokens(lm, 9, seed=5)
    L = len(prefix)
    a, b, tokens, positions, slots, mask = _two_branch_tree(lm, L)
    cache = lm.model.new_cache(1, 64)
    _forward(lm, cache, prefix, 0)
    cache.set_length(0, L)
    tree = lm.model.compute_logits(lm.model(tokens, positions, cache, slots=slots, attn_mask=mask))[0]
    chain_a = _fresh(lm, prefix + a)[-2:]
    chain_b = _fresh(lm, prefix + b)[-2:]
    assert _maxdiff(tree[0:2], chain_a) < TOL
    assert _maxdiff(tree[2:4], chain_b) < TOL
    # The branches really differ (the test would be vacuous otherwise).
    assert _maxdiff(tree[1], tree[3]) > 1e-2


@pytest.mark.parametrize("accepted", [[2, 3], [2], [0, 1]], ids=["branch_b", "b0_only", "branch_a"])
def test_compact_accepted_path_then_continue_equals_fresh(lm: LoadedModel, accepted: list[int]) -> None:
    prefix = _tokens(lm, 9, seed=6)
    L = len(prefix)
    a, b, tokens, positions, slots, mask = _two_branch_tree(lm, L)
    cache = lm.model.new_cache(1, 64)
    _forward(lm, cache, prefix, 0)
    cache.set_length(0, L)
    lm.model(tokens, positions, cache, slots=slots, attn_mask=mask)
    cache.set_length(0, L + 4)

    cache.compact(0, [L + i for i in accepted], L)
    cache.truncate(L + len(accepted))
    path = [(a + b)[i] for i in accepted]

    # The compacted K/V equal those of a plain chain over the accepted path, entry for entry.
    fresh_cache = lm.model.new_cache(1, 64)
    _forward(lm, fresh_cache, prefix + path, 0)
    n = L + len(accepted)
    assert _maxdiff(cache.k[:, :, :, :n], fresh_cache.k[:, :, :, :n]) < TOL
    assert _maxdiff(cache.v[:, :, :, :n], fresh_cache.v[:, :, :, :n]) < TOL

    # Continuing (bonus token, then a chunk) equals a fresh run over the whole sequence.
    bonus, more = _tokens(lm, 1, seed=7), _tokens(lm, 3, seed=8)
    got1 = _forward(lm, cache, bonus, n)
    cache.set_length(0, n + 1)
    got2 = _forward(lm, cache, more, n + 1)
    want = _fresh(lm, prefix + path + bonus + more)
    assert _maxdiff(got1[-1], want[n]) < TOL
    assert _maxdiff(got2, want[n + 1 :]) < TOL


def test_batch_rows_of_different_lengths_equal_single_rows(lm: LoadedModel) -> None:
    prompts = [_tokens(lm, 6, seed=20), _tokens(lm, 11, seed=21)]
    lens = [len(p) for p in prompts]
    T = max(lens)
    pad = 0

    # Each row alone: prefill, then 4 greedy single-token steps, then a 3-token chunk.
    solo: list[list[torch.Tensor]] = []
    feeds: list[list[int]] = []
    for p in prompts:
        cache = lm.model.new_cache(1, 64)
        out = [_forward(lm, cache, p, 0)[-1]]
        fed = []
        n = len(p)
        for _ in range(4):
            tok = int(out[-1].argmax())
            fed.append(tok)
            out.append(_forward(lm, cache, [tok], n)[-1])
            n += 1
        chunk = [int(out[-1].argmax()), *_tokens(lm, 2, seed=n)]
        fed += chunk
        out.append(_forward(lm, cache, chunk, n))
        solo.append(out)
        feeds.append(fed)

    # Both rows in one batch: right-padded prefill, then per-row positions/slots.
    cache = lm.model.new_cache(2, 64)
    toks = torch.tensor([p + [pad] * (T - len(p)) for p in prompts])
    pos = torch.arange(T).expand(2, T)
    logits = lm.model.compute_logits(lm.model(toks, pos, cache))
    for r in range(2):
        cache.set_length(r, lens[r])
        assert _maxdiff(logits[r, lens[r] - 1], solo[r][0]) < TOL
    n = list(lens)
    for step in range(4):
        toks = torch.tensor([[feeds[r][step]] for r in range(2)])
        pos = torch.tensor([[n[0]], [n[1]]])  # row 0 overwrites its pad slots, row 1 goes on
        logits = lm.model.compute_logits(lm.model(toks, pos, cache))
        for r in range(2):
            assert _maxdiff(logits[r, 0], solo[r][step + 1]) < TOL, f"row {r} step {step}"
            n[r] += 1
            cache.set_length(r, n[r])
    toks = torch.tensor([feeds[r][4:] for r in range(2)])
    pos = torch.stack([torch.arange(n[r], n[r] + 3) for r in range(2)])
    logits = lm.model.compute_logits(lm.model(toks, pos, cache))
    for r in range(2):
        assert _maxdiff(logits[r], solo[r][5]) < TOL


def test_forward_beyond_cache_size_is_a_clear_error(lm: LoadedModel) -> None:
    cache = lm.model.new_cache(1, 8)
    with pytest.raises(ValueError, match="beyond the cache size"):
        _forward(lm, cache, _tokens(lm, 3, seed=30), 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_attention_rows_equal_single_query_decodes_bit_for_bit(dtype: torch.dtype) -> None:
    """Each verified row attends exactly as the single-token decode of its token would: same keys in slot
    order, same operations, so the same bits, whatever else the forward holds (masked tree siblings, more
    rows); and it is attention (close to SDPA)."""
    from specdecode.model.transformer import row_attention

    g = torch.Generator().manual_seed(0)
    heads, kvh, hd, prefix, t = 6, 2, 16, 37, 9
    q = torch.randn(1, heads, t, hd, generator=g).to(dtype)
    keys = torch.randn(1, kvh, prefix + t, hd, generator=g).to(dtype)
    values = torch.randn(1, kvh, prefix + t, hd, generator=g).to(dtype)
    parents = [-1, 0, 0, 1, 1, 2, 3, -1, 7]  # a tree of 7 nodes and a second root with a child
    mask = torch.zeros(1, 1, t, prefix + t, dtype=torch.bool)
    mask[..., :prefix] = True
    for node in range(t):
        j = node
        while j >= 0:
            mask[0, 0, node, prefix + j] = True
            j = parents[j]
    out = row_attention(q, keys, values, mask)  # [1, H, T, hd]
    for node in range(t):
        seen = mask[0, 0, node].nonzero().squeeze(-1)  # the cache a decode of this token would hold
        alone = row_attention(q[:, :, node : node + 1], keys[:, :, seen], values[:, :, seen], None)
        assert torch.equal(out[:, :, node : node + 1], alone)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                                           enable_gqa=True)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
