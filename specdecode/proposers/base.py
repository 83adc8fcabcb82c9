"""What every proposer offers the engine: `begin`, `propose`, `on_verified`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdecode.sampling import SamplingParams


@dataclass
class SequenceView:
    """The read-only facts about one sequence a proposer may use.

    `token_ids` holds prompt + output; the target has processed all but the last one.
    """

    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator
    output_counts: torch.Tensor | None = None  # [V] occurrences in the output, only with penalties
    prompt_mask: torch.Tensor | None = None  # [V] bool, only with penalties


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    """[k, V] processed draft probabilities, or None for a point mass (n-gram, greedy draft)."""
    parents: list[int] | None = None
    """For a tree: parent of each draft token as a tree index (0 = the pending token, j+1 = tokens[j]);
    None for a chain. Tree children are deterministic candidates (point masses)."""

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def __len__(self) -> int:
        return len(self.tokens)


class Proposer(Protocol):
    name: str

    def begin(self, seq: SequenceView) -> None:
        """A new sequence starts (prompt known, nothing generated)."""

    def propose(self, seq: SequenceView, k: int) -> Draft:
        """Offer up to k draft tokens continuing seq.token_ids."""

    def on_verified(self, seq: SequenceView, num_accepted: int) -> None:
        """The last draft had num_accepted tokens kept; seq.token_ids already holds the step's output."""

    def step_cost_hint(self) -> float:
        """Seconds per drafted token (0 for free proposers); measured at start-up by the engine."""
