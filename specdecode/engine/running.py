"""A running request's row state in the engine: its sequence, drafting policy, prefill progress and the
target's features of its kept positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdecode.engine.adaptive import AcceptanceTracker, AdaptiveK
from specdecode.engine.sequence import Sequence
from specdecode.proposers.base import Draft


@dataclass
class Running:
    seq: Sequence
    key: int
    """The row's drafting state in the batch proposer."""
    policy: AdaptiveK | None
    """None: the row never drafts (no proposer, or the request asked for k = 0)."""
    prefilled: int = 0
    """Prompt tokens whose K/V is in the row (a prefix-cache hit, then prefill chunks)."""
    started: float = 0.0
    """perf_counter when its first prefill forward began (0: not yet)."""
    guess_rate: AcceptanceTracker = field(default_factory=lambda: AcceptanceTracker(per_position=False))
    """Acceptance of the prompt-lookup guess proposed alone, one rate for every position (engine/lookup_guess.py)."""
    guessed: int = 0
    """Tokens of the guess the row proposed alone in this step (0: its drafter's tree, or nothing)."""
    drafted: Draft | None = None
    """A lookup proposer's draft, drafted in this step's schedule (drafting costs nothing, so the batch prices what
    the lookup found rather than the k it was allowed); None: drafted after the schedule, or not at all."""
    features: torch.Tensor | None = None
    """[size, F] the target's features of the row's kept positions, pooled with its K/V blocks or copied by
    its sibling choices (only for proposers that read them, with the prefix cache on or a prefill group)."""

    def keep_features(self, features: torch.Tensor, at: int, size: int) -> None:
        """Record features [m, F] of positions at..at+m in a buffer of `size` positions."""
        if self.features is None:
            self.features = features.new_empty(size, features.shape[-1])
        self.features[at : at + features.shape[0]] = features
