"""Golden and property tests of the pure n-gram (prompt lookup) match."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.proposers.ngram_match import cap_draft_len, ngram_match


def test_longest_match_wins_over_shorter() -> None:
    # Suffix [7, 8, 9]: the 1-gram [9] occurs at index 1 (-> 50), the 3-gram at 4..6 (-> 60).
    tokens = [1, 9, 50, 0, 7, 8, 9, 60, 61, 3, 8, 9, 70, 7, 8, 9]
    assert ngram_match(tokens, min_n=1, max_n=3, k=2) == [60, 61]
    # With max_n = 2, the 2-gram [8, 9] ties between index 5 and index 10: most recent wins.
    assert ngram_match(tokens, min_n=1, max_n=2, k=2) == [70, 7]
    # With max_n = 1, [9] occurs at 1, 6, 11: most recent with 2 tokens after it is 11.
    assert ngram_match(tokens, min_n=1, max_n=1, k=2) == [70, 7]


def test_tie_rule_most_recent_with_full_continuation() -> None:
    # Pattern [5, 6] occurs at 0 (-> 10, 11) and at 4 (-> 20, 21); the suffix is at 8.
    tokens = np.array([5, 6, 10, 11, 5, 6, 20, 21, 5, 6])
    assert ngram_match(tokens, min_n=2, max_n=2, k=2) == [20, 21]
    # k = 4: the newest occurrence has only 4 tokens after it (20 21 5 6) -> still the newest.
    assert ngram_match(tokens, min_n=2, max_n=2, k=4) == [20, 21, 5, 6]
    # k = 5: only the occurrence at 0 has 5 tokens after it.
    assert ngram_match(tokens, min_n=2, max_n=2, k=5) == [10, 11, 5, 6, 20]


def test_tie_rule_falls_back_to_earliest_when_no_full_continuation() -> None:
    # Period-1 repetition: every earlier position matches [4]; the newest full-k one is chosen.
    assert ngram_match([4, 4, 4, 4, 4, 4], min_n=1, max_n=1, k=3) == [4, 4, 4]
    # k larger than anything available: the earliest occurrence gives the longest draft.
    assert ngram_match([1, 4, 2, 4, 3, 4], min_n=1, max_n=1, k=10) == [2, 4, 3, 4]


def test_no_match_returns_empty() -> None:
    assert ngram_match([1, 2, 3, 4, 5], min_n=1, max_n=3, k=4) == []
    assert ngram_match([], min_n=1, max_n=3, k=4) == []
    assert ngram_match([7], min_n=1, max_n=3, k=4) == []


def test_match_near_end_returns_fewer_than_k() -> None:
    # [1, 2] occurs once before the suffix, followed by only 3 tokens (9, 1, 2).
    assert ngram_match([8, 1, 2, 9, 1, 2], min_n=2, max_n=2, k=5) == [9, 1, 2]
    # Overlapping occurrence right before the suffix: [3] at index 0 -> only [3] follows.
    assert ngram_match([3, 3], min_n=1, max_n=2, k=4) == [3]


def test_min_n_respected() -> None:
    # Only a 1-gram ([9]) matches; min_n = 2 forbids it.
    tokens = [9, 5, 1, 2, 9]
    assert ngram_match(tokens, min_n=1, max_n=3, k=2) == [5, 1]
    assert ngram_match(tokens, min_n=2, max_n=3, k=2) == []


def test_max_n_caps_the_pattern() -> None:
    # A 3-gram match exists at index 0 (-> 40) but a newer 2-gram one at 5 (-> 50);
    # with max_n = 2 both are 2-gram ties and recency picks 50.
    tokens = [1, 2, 3, 40, 0, 2, 3, 50, 9, 1, 2, 3]
    assert ngram_match(tokens, min_n=1, max_n=3, k=1) == [40]
    assert ngram_match(tokens, min_n=1, max_n=2, k=1) == [50]


def test_k_zero_returns_empty() -> None:
    assert ngram_match([1, 2, 1, 2], min_n=1, max_n=2, k=0) == []


def test_returns_python_ints() -> None:
    out = ngram_match(np.array([1, 2, 1], dtype=np.int32), min_n=1, max_n=2, k=2)
    assert out == [2, 1] and all(type(t) is int for t in out)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ngram_match([1, 2], min_n=0, max_n=2, k=1)
    with pytest.raises(ValueError):
        ngram_match([1, 2], min_n=3, max_n=2, k=1)


def test_fast_on_4k_tokens() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=4096)  # small vocabulary: many partial matches
    start = time.perf_counter()
    for _ in range(100):
        ngram_match(tokens, min_n=1, max_n=4, k=8)
    per_call = (time.perf_counter() - start) / 100
    assert per_call < 5e-3, f"{per_call * 1e3:.2f} ms per call"


@pytest.mark.parametrize(
    ("k", "seq_len", "max_context", "tokens_left", "expected"),
    [
        (4, 10, 100, 50, 4),  # nothing binds
        (4, 97, 100, 50, 2),  # 97 + 2 + 1 = 100
        (4, 99, 100, 50, 0),  # only the bonus token fits
        (4, 100, 100, 50, 0),  # never negative
        (4, 10, 100, 3, 2),  # 3 tokens left: 2 drafts + 1 bonus
        (4, 10, 100, 1, 0),
        (4, 10, 100, 0, 0),
        (0, 10, 100, 50, 0),
        (8, 95, 100, 3, 2),  # the tighter of the two limits
    ],
)
def test_cap_draft_len(k: int, seq_len: int, max_context: int, tokens_left: int, expected: int) -> None:
    assert cap_draft_len(k, seq_len, max_context, tokens_left) == expected


def _occurs(tokens: list[int], pattern: list[int], end_exclusive: int) -> list[int]:
    """Start positions j < end_exclusive with tokens[j:j+len(pattern)] == pattern (brute force)."""
    n = len(pattern)
    return [j for j in range(end_exclusive) if tokens[j : j + n] == pattern]


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    min_n=st.integers(1, 3),
    extra_n=st.integers(0, 2),
    k=st.integers(0, 6),
)
def test_property_draft_continues_an_occurrence(tokens: list[int], min_n: int, extra_n: int, k: int) -> None:
    max_n = min_n + extra_n
    draft = ngram_match(tokens, min_n, max_n, k)
    length = len(tokens)
    # Brute-force reference: the longest n in [min_n, max_n] with an earlier occurrence.
    best = None
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = _occurs(tokens, tokens[length - n :], length - n)
        if starts:
            best = (n, starts)
            break
    if best is None or k == 0:
        assert draft == []
        return
    n, starts = best
    assert 1 <= len(draft) <= k
    # The draft really continues some occurrence of the length-n suffix ...
    continuations = [tokens[j + n : j + n + k] for j in starts]
    assert draft in continuations
    # ... and it is the one the documented tie rule picks.
    full = [j for j in starts if j + n + k <= length]
    j = full[-1] if full else starts[0]
    assert draft == tokens[j + n : j + n + k]
