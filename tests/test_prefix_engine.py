"""Prefix caching and chunked prefill through the engine, fp32 greedy: every method gives the same tokens with
the pool on and off (shared system prompts, a second turn over the first turn's answer, requests joining while
others speculate), a tiny pool that evicts changes nothing and stays in its bound, a long prompt is prefilled
in chunks while a running row keeps getting tokens, and a soak of mixed requests runs clean."""

from __future__ import annotations

import hashlib
import random
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine import prefix_cache
from specdecode.engine.core import Engine
from specdecode.engine.sequence import Sequence

SYSTEM = list(range(3, 3 + 37))  # a shared "system prompt" of 37 tokens: two full blocks and a bit
SUFFIXES = [[100, 101], [102, 7, 9, 11], [103], [104, 105, 106, 107, 108, 109, 110], [111, 12]]
MAX_TOKENS = [14, 9, 17, 6, 12]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _methods(tiny: Path, other: Path, heads: dict[str, Path]) -> dict[str, dict[str, Any] | None]:
    return {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft-chain": {"method": "draft", "model": str(tiny), "num_speculative_tokens": 4},
        "draft-tree": {"method": "draft", "model": str(other), "num_speculative_tokens": 3, "draft_tree_width": 2},
        "medusa": {"method": "medusa", "model": str(heads["medusa"]), "num_speculative_tokens": 3},
        "eagle-tree": {"method": "eagle", "model": str(heads["eagle"]), "num_speculative_tokens": 4,
                       "draft_tree_width": 3, "draft_prompt_lookup": False},
    }


def _drive(llm: LLM, engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[Sequence]:
    """Two requests at once, then one more every second step (rows join while others speculate)."""
    seqs = [llm.new_sequence(p, _params(n)) for p, n in zip(prompts, max_tokens, strict=True)]
    pending = list(seqs)
    for s in pending[:2]:
        engine.add(s)
    pending = pending[2:]
    steps = 0
    while engine.has_work() or pending:
        if pending and steps % 2 == 0:
            engine.add(pending.pop(0))
        engine.step()
        pool = engine.prefix_cache
        assert pool is None or pool.bytes_used <= pool.max_bytes
        steps += 1
    return seqs


def _conversation(llm: LLM, engine: Engine) -> list[list[int]]:
    """Shared-prefix requests, then second turns: each first turn's prompt + answer + a new user turn."""
    first = [SYSTEM + s for s in SUFFIXES]
    outs = [s.output_ids for s in _drive(llm, engine, first, MAX_TOKENS)]
    second = [p + o + [120, 121, 122] for p, o in zip(first, outs, strict=True)]
    seqs = _drive(llm, engine, second, [8] * len(second))
    if llm.prefix_cache is not None and llm.prefix_cache.max_bytes > 1 << 20:
        # The first turn's committed tokens (all but its last output) were pooled when it finished, the last
        # partial block included.
        assert [s.cached_tokens for s in seqs] == [len(p) + len(o) - 1 for p, o in zip(first, outs, strict=True)]
    return outs + [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    """Plain decoding without the pool or chunks, one request at a time."""
    plain = LLM(str(tiny_llama_dir), dtype="fp32", enable_prefix_caching=False, max_num_batched_tokens=None)
    return _conversation(plain, plain.batch_engine(max_num_seqs=1))


@pytest.mark.parametrize("method", ["plain", "ngram", "draft-chain", "draft-tree", "medusa", "eagle-tree"])
def test_every_method_equals_plain_with_the_pool(method: str, tiny_llama_dir: Path, tiny_llama_other_dir: Path,
                                                 tiny_heads: dict[str, Path], reference: list[list[int]]) -> None:
    spec = _methods(tiny_llama_dir, tiny_llama_other_dir, tiny_heads)[method]
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec, max_num_batched_tokens=16)
    engine = llm.batch_engine(max_num_seqs=3)
    assert _conversation(llm, engine) == reference, method
    pool = llm.prefix_cache
    assert pool is not None and pool.hit_tokens >= 32 * 4 + 32 * 5  # every later system prompt, every 2nd turn


def test_a_tiny_pool_evicts_and_changes_nothing(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              prefix_cache_gb=0)
    assert llm.prefix_cache is None
    block_bytes = llm_kv_bytes(tiny_llama_dir) * 16  # k and v of 16 tokens, fp32
    tiny = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
               prefix_cache_gb=3 * block_bytes / 2**30)
    engine = tiny.batch_engine(max_num_seqs=2)
    assert _conversation(tiny, engine) == reference
    pool = tiny.prefix_cache
    assert pool is not None and 0 < pool.bytes_used <= pool.max_bytes and len(pool.blocks) <= 3
    assert pool.hit_tokens > 0


def test_chunked_prefill_interleaves_with_a_running_row(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", enable_prefix_caching=False, max_num_batched_tokens=16)
    rng = random.Random(3)
    long_prompt = [rng.randrange(3, 300) for _ in range(150)]
    short = llm.new_sequence([5, 6, 7], _params(40))
    brief = llm.new_sequence([8, 9], _params(4))  # leaves mid-prefill: the prefilling row moves down a row
    long = llm.new_sequence(long_prompt, _params(10))
    engine = llm.batch_engine(max_num_seqs=3)
    engine.add(brief)
    engine.add(short)
    engine.step()
    engine.add(long)
    chunk_steps = 0
    while engine.has_work():
        before = short.num_output
        engine.step()
        if engine.prefilling is not None:  # the long prompt is still coming in: the short row kept decoding
            chunk_steps += 1
            assert engine.prefilling.prefilled <= 16 * (chunk_steps)
            assert short.num_output == before + 1
    assert chunk_steps == 150 // 16  # 10 chunks: nine steps with the prompt unfinished, the last joins
    whole = LLM(str(tiny_llama_dir), dtype="fp32", enable_prefix_caching=False, max_num_batched_tokens=None)
    assert [o.token_ids for o in whole.generate([[5, 6, 7]], _params(40))] == [short.output_ids]
    assert [o.token_ids for o in whole.generate([[8, 9]], _params(4))] == [brief.output_ids]
    assert [o.token_ids for o in whole.generate([long_prompt], _params(10))] == [long.output_ids]


def _sorted_digest(parent: bytes, tokens: list[int]) -> bytes:
    """A weak digest: any permutation of a block, after the same (or a colliding) parent, collides."""
    return hashlib.blake2b(parent + array("q", sorted(tokens)).tobytes(), digest_size=16).digest()


@pytest.mark.parametrize(("digest", "blocks"), [("sorted", 3), ("sorted", 1000), ("constant", 1000)])
def test_colliding_keys_change_no_output(digest: str, blocks: int, tiny_llama_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced key collisions (a weak digest; a tiny pool that evicts, or a roomy one) never reuse K/V computed
    after other tokens: every output equals plain decoding's."""
    weak = _sorted_digest if digest == "sorted" else lambda parent, tokens: bytes(16)
    monkeypatch.setattr(prefix_cache, "block_digest", weak)
    head, mid, other = SYSTEM[:16], SYSTEM[16:32], list(range(200, 216))
    flipped = head[::-1]  # collides with head, and so does every block after each
    # The third prompt is the attack's victim: the second's `other` block, computed after `flipped`, must not
    # pass for the one after `head`.
    prompts = [head + mid + [100], flipped + other + [101], head + other + [102, 7], flipped + mid + [103],
               flipped[:8] + head[8:] + mid + [104], head + mid[::-1] + [105]]
    plain = LLM(str(tiny_llama_dir), dtype="fp32", enable_prefix_caching=False, max_num_batched_tokens=None)
    want = [o.token_ids for o in plain.generate(prompts, _params(8))]
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              prefix_cache_gb=blocks * 16 * llm_kv_bytes(tiny_llama_dir) / 2**30, max_num_batched_tokens=16)
    seqs = _drive(llm, llm.batch_engine(max_num_seqs=2), prompts, [8] * len(prompts))
    assert [s.output_ids for s in seqs] == want
    if digest == "sorted" and blocks > 3:  # honest reuse still works: the head's block is read
        assert seqs[2].cached_tokens >= 16


def test_cached_tokens_in_request_metrics(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32")
    a, b = llm.generate([SYSTEM + [100], SYSTEM + [101]], _params(3))
    assert a.metrics["cached_tokens"] == 0 and b.metrics["cached_tokens"] == len(SYSTEM)


def test_a_prompt_dicts_cache_salt_picks_its_namespace(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", enable_prefix_caching=True)
    [first] = llm.generate({"prompt_token_ids": SYSTEM + [100], "cache_salt": "tenant-a"}, _params(4))
    other, same, none = (llm.generate({"prompt_token_ids": SYSTEM + [101], **salt}, _params(4))[0]
                         for salt in ({"cache_salt": "tenant-b"}, {"cache_salt": "tenant-a"}, {}))
    assert first.metrics["cached_tokens"] == 0
    assert other.metrics["cached_tokens"] == 0 and none.metrics["cached_tokens"] == 0
    assert same.metrics["cached_tokens"] == len(SYSTEM)  # what the same tenant computed
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": "hi", "cache_salt": ""}, _params(1))


def test_soak_of_mixed_requests(tiny_llama_dir: Path) -> None:
    """200 requests: shared and fresh prefixes, greedy and sampled, a small pool and small chunks; some aborted."""
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              prefix_cache_gb=40 * 16 * llm_kv_bytes(tiny_llama_dir) / 2**30, max_num_batched_tokens=16)
    engine = llm.batch_engine(max_num_seqs=4, max_waiting=500)
    rng = random.Random(0)
    seqs = []
    for i in range(200):
        prefix = SYSTEM[: rng.choice([0, 16, 37])]
        prompt = prefix + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 60))]
        params = SamplingParams(max_tokens=rng.randrange(1, 6), temperature=rng.choice([0.0, 0.8]), seed=i,
                                ignore_eos=True)
        seqs.append(llm.new_sequence(prompt, params))
    for s in seqs:
        engine.add(s, rng.choice([None, 0, 2]))  # adaptive k, no drafting, a fixed k
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps % 37 == 0 and engine.running:  # a client goes away
            engine.abort(engine.running[0].seq.request_id)
        if steps % 11 == 0 and engine.prefilling is not None:  # ... while its prompt is coming in
            engine.abort(engine.prefilling.seq.request_id)
        pool = engine.prefix_cache
        assert pool is not None and pool.bytes_used <= pool.max_bytes
    assert all(s.finished for s in seqs)
    assert sum(s.finish_reason == "length" for s in seqs) >= 150
    assert sum(s.finish_reason == "abort" and s.num_output == 0 for s in seqs) >= 2  # aborted mid-prefill
    assert engine.prefix_cache is not None and engine.prefix_cache.hit_tokens > 0


def llm_kv_bytes(model_dir: Path) -> int:
    from specdecode.model.load import read_config

    return read_config(model_dir).kv_bytes_per_token(4)


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_models_with_pool_and_chunks(kind: str, tmp_path: Path) -> None:
    """Models masking by position distance: pooled blocks carry their positions, chunks record theirs."""
    from arch_helpers import make_hf_dir

    path = make_hf_dir(tmp_path / kind, kind)
    plain = LLM(str(path), dtype="fp32", enable_prefix_caching=False, max_num_batched_tokens=None)
    cached = LLM(str(path), dtype="fp32", max_num_batched_tokens=8,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = [SYSTEM + s for s in SUFFIXES[:3]]
    want = [plain.generate([p], _params(12))[0].token_ids for p in prompts]
    engine = cached.batch_engine(max_num_seqs=2)
    seqs = _drive(cached, engine, prompts, [12] * 3)
    assert [s.output_ids for s in seqs] == want
    assert [s.cached_tokens for s in seqs][1:] == [len(SYSTEM)] * 2


def test_pooled_blocks_hold_the_committed_tokens_kv(tiny_llama_dir: Path, tiny_llama_other_dir: Path,
                                                    tiny_heads: dict[str, Path]) -> None:
    """After tree speculation (scratch slots past the prefix, compaction, rejected drafts), every pooled block of
    a finished request equals a fresh prefill of its tokens."""
    spec = _methods(tiny_llama_dir, tiny_llama_other_dir, tiny_heads)["draft-tree"]
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    seq = llm.run_sequences([llm.new_sequence(SYSTEM + [100, 101], _params(40))])[0]
    assert seq.stats.draft_tokens > 0
    committed = seq.token_ids[:-1]  # the last output token has no K/V yet
    pool = llm.prefix_cache
    assert pool is not None
    blocks = pool.match(committed, len(committed))
    assert [len(b.tokens) for b in blocks] == [16] * (len(committed) // 16) + [len(committed) % 16]  # outputs too
    assert len(blocks) >= 5
    model = llm.target.model
    fresh = model.new_cache(1, 128)
    model(torch.tensor([committed]), torch.arange(len(committed))[None], fresh)
    for i, b in enumerate(blocks):
        span = slice(16 * i, 16 * i + len(b.tokens))
        torch.testing.assert_close(b.k, fresh.k[:, 0, :, span], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(b.v, fresh.v[:, 0, :, span], atol=1e-5, rtol=1e-4)


def test_the_pool_counts_in_the_servers_memory_check(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdecode.engine import validation
    from specdecode.engine.validation import InsufficientMemoryError

    llm = LLM(str(tiny_llama_dir), dtype="fp32", max_model_len=256, prefix_cache_gb=2.0)
    monkeypatch.setattr(validation, "available_bytes", lambda device: 1 << 30)  # the rows fit, the pool does not
    with pytest.raises(InsufficientMemoryError, match="prefix cache 2.00 GiB"):
        llm.batch_engine(max_num_seqs=2)
    monkeypatch.setattr(validation, "available_bytes", lambda device: 3 << 30)
    assert llm.batch_engine(max_num_seqs=2).prefix_cache is llm.prefix_cache
