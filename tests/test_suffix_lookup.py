"""Suffix decoding's pure parts: the continuation trie, the index of earlier answers, the store's scopes and
bound, and the source that picks between a row's own text and earlier answers."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.proposers.base import ProposeRow, SequenceView
from specdecode.proposers.suffix import SuffixRows
from specdecode.proposers.suffix_index import SuffixIndex, SuffixStore
from specdecode.proposers.suffix_source import PROMPT_CONTEXT, SuffixSource
from specdecode.proposers.suffix_trie import ContinuationTrie
from specdecode.sampling import SamplingParams


def test_the_trie_counts_continuations_and_ranks_nodes_by_their_share() -> None:
    trie = ContinuationTrie([[1, 2, 3], [1, 2, 4], [1, 5], [6]], max_depth=3)
    assert trie.chain(3) == [1, 2, 3]  # 1 (3 of 4), 2 (2 of 4), then 3 and 4 tie: the first inserted
    tree = trie.tree(max_nodes=10)
    assert tree.tokens == [1, 2, 3, 4, 5, 6]  # equal shares: the first inserted first
    assert tree.parents == [0, 1, 2, 2, 1, 0]
    assert tree.probs == [0.75, 0.5, 0.25, 0.25, 0.25, 0.25]
    assert tree.score == pytest.approx(2.25)
    assert trie.tree(max_nodes=2).tokens == [1, 2]
    assert trie.tree(max_nodes=10, min_prob=0.3).tokens == [1, 2]
    assert ContinuationTrie([[1, 2, 3]], max_depth=2).chain(5) == [1, 2]
    assert not ContinuationTrie([], 4) and ContinuationTrie([], 4).tree(4).tokens == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), max_size=6), max_size=8), st.integers(1, 12))
def test_a_trie_tree_is_a_valid_subtree_of_distinct_siblings(conts: list[list[int]], max_nodes: int) -> None:
    tree = ContinuationTrie(conts, max_depth=5).tree(max_nodes)
    assert len(tree.tokens) <= max_nodes
    seen = set()
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True), 1):
        assert 0 <= parent < i  # parents before their children
        assert (parent, tok) not in seen
        seen.add((parent, tok))
        if parent:
            assert tree.probs[i - 1] <= tree.probs[parent - 1]
    # every path of the tree is a prefix of some continuation
    for i in range(1, len(tree.tokens) + 1):
        path, node = [], i
        while node:
            path.append(tree.tokens[node - 1])
            node = tree.parents[node - 1]
        assert any(c[: len(path)] == path[::-1] for c in conts)


def test_the_index_finds_the_longest_match_and_its_continuations_newest_first() -> None:
    index = SuffixIndex()
    index.add("a", [1, 2, 3, 4, 5, 6])
    index.add("b", [9, 3, 4, 7, 8])
    index.add("c", [2, 3, 4, 5, 10])
    occ = index.occurrences([0, 2, 3, 4, 5], max_n=16, depth=3)
    assert occ.length == 4 and occ.continuations == [[10], [6]]  # c is newer than a
    assert index.occurrences([0, 3, 4], max_n=16, depth=2).continuations == [[5, 10], [7, 8], [5, 6]]
    assert index.occurrences([0, 2, 3, 4, 5], max_n=2, depth=1).length == 2  # capped
    assert index.occurrences([4, 4], max_n=16, depth=2).length == 0
    index.remove("c")
    assert index.occurrences([0, 2, 3, 4, 5], max_n=16, depth=3).continuations == [[6]]
    index.remove("a")
    index.remove("b")
    assert index.tokens == 0 and not index._index  # nothing left behind


def test_the_store_is_bounded_and_evicts_the_oldest_answers() -> None:
    store = SuffixStore("global", max_tokens=10)
    store.remember(None, [1, 2, 3, 4, 5, 6])
    store.remember(None, [7, 8, 9, 7, 8])
    assert store.tokens == 5  # the first no longer fits beside the second
    assert store.occurrences(None, [1, 2], 16, 2).length == 0
    assert store.occurrences(None, [7, 8], 16, 1).continuations == [[9]]
    store.remember(None, list(range(20, 40)))  # longer than the bound: its end is kept
    assert store.tokens == 10 and store.occurrences(None, [30, 31], 16, 1).continuations == [[32]]
    assert store.occurrences(None, [7, 8], 16, 1).length == 0
    assert store.approx_bytes > 0


def test_scopes_keep_tenants_apart() -> None:
    shared, keyed, none = SuffixStore("global"), SuffixStore("key"), SuffixStore("request")
    for store in (shared, keyed, none):
        store.remember("alice", [1, 2, 3, 4])
    assert shared.occurrences("bob", [1, 2], 16, 2).continuations == [[3, 4]]
    assert keyed.occurrences("bob", [1, 2], 16, 2).length == 0
    assert keyed.occurrences(None, [1, 2], 16, 2).length == 0
    assert keyed.occurrences("alice", [1, 2], 16, 2).continuations == [[3, 4]]
    assert none.occurrences("alice", [1, 2], 16, 2).length == 0 and none.tokens == 0
    with pytest.raises(ValueError, match="scope"):
        SuffixStore("everyone")


def test_the_store_takes_answers_from_several_threads() -> None:
    store = SuffixStore("global", max_tokens=2000)

    def work(base: int) -> None:
        for i in range(50):
            store.remember(None, [base, i, base + 1, i + 1])
            store.occurrences(None, [base, i], 16, 2)

    threads = [threading.Thread(target=work, args=(b,)) for b in (100, 200, 300, 400)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.tokens == 800


def test_the_source_prefers_the_longer_match_and_pools_equal_ones() -> None:
    store = SuffixStore("global")
    source = SuffixSource(2, store)
    own = [1, 2, 3, 9, 8, 1, 2, 3]  # own text: 1 2 3 -> 9 8
    assert source.chain(own, None, 2) == [9, 8]
    store.remember(None, [0, 1, 2, 3, 4, 5])  # an earlier answer matches 0 1 2 3 (longer than own's 1 2 3)
    assert source.chain([1, 2, 3, 9, 8, 0, 1, 2, 3], None, 2) == [4, 5]
    store.remember(None, [7, 1, 2, 3, 4, 5])  # equal lengths (1 2 3) pool: 4 5 twice against 9 8 once
    assert source.chain(own, None, 2) == [4, 5]
    assert SuffixSource(2).chain(own, None, 2) == [9, 8]  # no store: own text only
    assert source.chain([5, 6], None, 2) == [] and source.chain(own, None, 0) == []


def test_the_source_keeps_an_answer_with_the_end_of_its_prompt() -> None:
    store = SuffixStore("global")
    source = SuffixSource(2, store)
    prompt, output = list(range(100, 120)), [1, 2, 3]
    source.remember(None, prompt + output, len(prompt))
    assert store.tokens == PROMPT_CONTEXT + len(output)
    source.remember(None, prompt, len(prompt))  # no output: nothing kept
    assert store.tokens == PROMPT_CONTEXT + len(output)
    assert source.chain([5, 118, 119], None, 3) == [1, 2, 3]  # the start of an answer is guessed


def _row(tokens: list[int], k: int, temperature: float = 0.0) -> ProposeRow:
    view = SequenceView(tokens, 1, SamplingParams(temperature=temperature), torch.Generator())
    return ProposeRow(0, view, k, k)


def test_the_suffix_proposer_drafts_at_most_k_nodes_and_one_per_matched_token() -> None:
    rows = SuffixRows(SuffixSource(2, SuffixStore("global")))
    copy = list(range(10, 30))
    (long,) = rows.propose([_row(copy + [0] + copy[:12], 8)])  # a 12-token match: the copy goes on
    assert long.tokens == copy[12:20] and long.parents == list(range(8))
    (short,) = rows.propose([_row([1, 2, 5, 6, 7, 0, 1, 2], 8)])  # a 2-token match: two nodes at most
    assert short.tokens == [5, 6]
    branching = [3, 0, 1, 2, 5, 9, 4, 0, 1, 2, 5, 9, 7, 0, 1, 2, 6, 9, 8, 0, 1, 2]  # 0 1 2 -> 5 9 twice, 6 9 once
    (tree,) = rows.propose([_row(branching, 3)])
    assert tree.tokens == [5, 9, 6] and tree.parents == [0, 1, 0]  # the likelier path, then the sibling
    assert rows.propose([_row([1, 2, 3], 4)])[0].tokens == []


def test_the_suffix_proposer_reads_earlier_answers_for_greedy_rows_only() -> None:
    store = SuffixStore("global")
    rows = SuffixRows(SuffixSource(2, store))
    store.remember(None, [7, 8, 9, 10, 11, 12])
    assert rows.propose([_row([0, 7, 8, 9], 3)])[0].tokens == [10, 11, 12]
    assert rows.propose([_row([0, 7, 8, 9], 3, temperature=0.7)])[0].tokens == []


def test_the_store_holds_at_most_its_bytes_per_token() -> None:
    """The bytes /metrics reports bound what the store holds: answers of random tokens (every n-gram new, the
    most an index can hold per token)."""
    import random
    import tracemalloc

    from specdecode.proposers.suffix_index import BYTES_PER_TOKEN

    rng = random.Random(0)
    answers = [[rng.randrange(300, 150_000) for _ in range(200)] for _ in range(100)]
    tracemalloc.start()
    try:
        store = SuffixStore("global")
        for answer in answers:
            store.remember(None, answer)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert store.tokens == 20_000
    assert held / store.tokens <= BYTES_PER_TOKEN and store.approx_bytes == store.tokens * BYTES_PER_TOKEN
