"""The lookup-or-draft choice's pure parts: a guess's expected tokens and rate, when it beats the drafter, how
long it runs, and matching a row's suffix once per step."""

from __future__ import annotations

import pytest

from specdecode.engine.adaptive import AcceptanceTracker
from specdecode.engine.lookup_guess import RowGuess, best_guess_len, expected_tokens, guess_beats
from specdecode.proposers.suffix_source import SuffixSource


def test_expected_tokens() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0


def test_guess_rate_pools_positions_up_to_the_first_rejection() -> None:
    rate = AcceptanceTracker(prior=0.5, decay=0.5, per_position=False)
    assert rate.alpha(0) == rate.alpha(3) == 0.5
    rate.update(4, 1)  # kept, rejected; positions 3 and 4 never judged
    assert rate.alpha(0) == rate.alpha(5) == pytest.approx((0.5 * 0.5 + 0.5) * 0.5)
    rate.update(2, 2)
    assert rate.alpha(0) == pytest.approx(0.375 * 0.25 + 0.5 * 0.5 + 0.5)
    rate.update(0, 0)  # nothing offered: nothing learnt
    assert rate.alpha(0) == pytest.approx(0.375 * 0.25 + 0.5 * 0.5 + 0.5)
    with pytest.raises(ValueError, match="accepted"):
        rate.update(1, 2)


def test_a_row_guess_reads_its_source_once_per_depth_and_is_the_most_frequent_continuation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # [5, 6] was followed by 10 11 once and by 20 21 twice: the most frequent continuation wins, and of its
    # equally frequent next tokens (7 and 9) the newest.
    tokens = [5, 6, 20, 21, 7, 5, 6, 10, 11, 8, 5, 6, 20, 21, 9, 5, 6]
    read = []
    trie = SuffixSource.trie
    monkeypatch.setattr(SuffixSource, "trie", lambda self, *args: read.append(args) or trie(self, *args))
    guess = RowGuess(tokens, SuffixSource(2))
    assert guess.tokens(2) == [20, 21]
    assert guess.tokens(1) == [20]
    assert len(read) == 1  # a shorter guess reads the same trie
    assert guess.tokens(4) == [20, 21, 9, 5]
    assert len(read) == 2
    assert RowGuess(tokens, None).tokens(4) == []  # lookup off
    assert RowGuess([1, 2, 3], SuffixSource(2)).tokens(4) == []  # no earlier occurrence


def flat(t: int) -> float:
    return 0.1


def _beats_chain(guess_len: int, guess_alpha: float, draft_alpha: float, step_seconds: float, k: int = 4) -> bool:
    """The guess against a draft chain of k tokens, each drafted in `step_seconds` and kept at `draft_alpha`."""
    return guess_beats(guess_len, guess_alpha, expected_tokens(draft_alpha, k), flat(k + 1) + k * step_seconds, flat)


def test_guess_beats_a_chain_by_tokens_per_second_of_step() -> None:
    assert not _beats_chain(0, 1.0, 0.0, 0.0)  # no guess
    # Equal acceptance: the guess is free, the draft is not.
    assert _beats_chain(4, 0.8, 0.8, 0.01)
    # A short guess of a mediocre source against a cheap, reliable draft: (1 + .5) / .1 < 4.69 / .14.
    assert not _beats_chain(1, 0.5, 0.95, 0.01)
    # The same draft, but each token costs a fifth of a target forward: 4.69 / .18 = 26 > 1.5 / .1 = 15;
    # a good guess wins: (1 + .9 + .81 + .73 + .66) / .1 = 41.
    assert not _beats_chain(1, 0.5, 0.95, 0.02)
    assert _beats_chain(4, 0.9, 0.95, 0.02)


def test_guess_beats_a_tree_by_tokens_per_second_of_step() -> None:
    def steep(t: int) -> float:  # a forward over more tokens costs more
        return 0.1 + 0.01 * t

    assert not guess_beats(0, 1.0, 1.0, 1.0, steep)  # no guess
    # A tree that emits 3 tokens in 0.2 s (15/s) against a 4-token guess at 0.8: 3.36 / 0.15 = 22/s.
    assert guess_beats(4, 0.8, 3.0, 0.2, steep)
    # The same guess against a tree of 5 tokens in 0.15 s (33/s).
    assert not guess_beats(4, 0.8, 5.0, 0.15, steep)
    # A guess that is seldom kept: 1.1 / 0.12 = 9/s.
    assert not guess_beats(1, 0.1, 3.0, 0.2, steep)


def test_best_guess_len_weighs_a_longer_tail_against_a_wider_forward() -> None:
    def flat(t: int) -> float:
        return 0.05

    def steep(t: int) -> float:  # a fixed cost plus a tenth of it per token verified
        return 0.1 + 0.01 * t

    def linear(t: int) -> float:  # every token verified costs as much as the first
        return 0.01 * t

    assert best_guess_len(8, 0.6, flat) == 8  # a free tail: every kept token is a gain
    assert best_guess_len(8, 0.95, steep) == 8  # a tail that is almost always kept repays its tokens
    # 1.5 / 0.12 = 12.5/s, 1.75 / 0.13 = 13.5/s, 1.875 / 0.14 = 13.4/s: a half-kept tail pays for one more token.
    assert best_guess_len(8, 0.5, steep) == 2
    assert best_guess_len(8, 0.95, linear) == 1  # each token kept at most as often as it costs
    assert best_guess_len(1, 0.1, steep) == 1
