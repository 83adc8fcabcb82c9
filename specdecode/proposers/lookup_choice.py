"""When a prompt-lookup guess beats running the drafter: pure functions of live acceptance and cost.

A draft model or a head drafts well but costs a forward per token or tree level; prompt lookup costs nothing
but offers a guess only when the suffix occurred before. When both can draft, propose the one with more
expected tokens per second of step. Expected tokens use one acceptance rate per source (the chance each next
token is kept, given the ones before were); costs come from the start-up measurement, never from a clock, so a
seeded request drafts the same way on every run.
"""

from __future__ import annotations

from collections.abc import Callable


class AcceptanceRate:
    """Exponential moving average of per-position acceptance: each offered position up to the first
    rejection counts as one observation (1 kept, 0 rejected); positions after it were never judged."""

    def __init__(self, prior: float = 0.6, decay: float = 0.9) -> None:
        if not 0.0 <= prior <= 1.0 or not 0.0 <= decay < 1.0:
            raise ValueError(f"need prior in [0, 1] and decay in [0, 1), got {prior} and {decay}")
        self.prior, self.decay = prior, decay
        self.value = prior

    def reset(self) -> None:
        self.value = self.prior

    def observe(self, offered: int, accepted: int) -> None:
        if not 0 <= accepted <= offered:
            raise ValueError(f"need 0 <= accepted ({accepted}) <= offered ({offered})")
        for i in range(min(offered, accepted + 1)):
            self.value = self.decay * self.value + (1.0 - self.decay) * (1.0 if i < accepted else 0.0)


def expected_tokens(alpha: float, n: int) -> float:
    """Tokens a step emits on average with n drafted tokens each kept with probability alpha given the
    ones before: the kept run plus the target's own (recovered or bonus) token."""
    return 1.0 + sum(alpha**i for i in range(1, n + 1))


def guess_beats(guess_len: int, guess_alpha: float, draft_tokens: float, draft_seconds: float,
                target_seconds: Callable[[int], float]) -> bool:
    """True when verifying the guess alone yields at least the tokens per second of the drafter's step, which
    emits `draft_tokens` on average in `draft_seconds` (a chain's or a tree's, its drafting included)."""
    if guess_len <= 0:
        return False
    return expected_tokens(guess_alpha, guess_len) / target_seconds(guess_len + 1) >= draft_tokens / draft_seconds


def best_guess_len(guess_len: int, guess_alpha: float, target_seconds: Callable[[int], float]) -> int:
    """The prefix of a guess (1..guess_len tokens) whose verification alone yields the most expected tokens per
    second: a longer guess costs a wider forward, worth it while its tail is likely to be kept."""
    return max(range(1, guess_len + 1), key=lambda n: expected_tokens(guess_alpha, n) / target_seconds(n + 1))
