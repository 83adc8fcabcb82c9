"""Pure rules for choosing a prompt-lookup guess over the draft model."""

from __future__ import annotations

import pytest

from specdecode.proposers.lookup_choice import AcceptanceRate, expected_tokens, guess_beats_draft


def test_expected_tokens() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0


def test_acceptance_rate_counts_positions_up_to_the_first_rejection() -> None:
    rate = AcceptanceRate(prior=0.5, decay=0.5)
    rate.observe(4, 1)  # kept, rejected; positions 3 and 4 never judged
    assert rate.value == pytest.approx((0.5 * 0.5 + 0.5) * 0.5)
    rate.observe(2, 2)
    assert rate.value == pytest.approx(0.375 * 0.25 + 0.5 * 0.5 + 0.5)
    rate.reset()
    assert rate.value == 0.5
    with pytest.raises(ValueError, match="accepted"):
        rate.observe(1, 2)


def flat(t: int) -> float:
    return 0.1


def test_guess_beats_draft() -> None:
    assert not guess_beats_draft(0, 4, 1.0, 0.0, flat, 0.0)  # no guess
    # Equal acceptance: the guess is free, the draft is not.
    assert guess_beats_draft(4, 4, 0.8, 0.8, flat, 0.01)
    # A short guess of a mediocre source against a cheap, reliable draft: (1 + .5) / .1 < 4.69 / .14.
    assert not guess_beats_draft(1, 4, 0.5, 0.95, flat, 0.01)
    # The same draft, but each token costs a fifth of a target forward: 4.69 / .18 = 26 > 1.5 / .1 = 15;
    # a good guess wins: (1 + .9 + .81 + .73 + .66) / .1 = 41.
    assert not guess_beats_draft(1, 4, 0.5, 0.95, flat, 0.02)
    assert guess_beats_draft(4, 4, 0.9, 0.95, flat, 0.02)
