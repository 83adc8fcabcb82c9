"""Prompt lookup: draft the tokens that followed an earlier occurrence of the current suffix."""

from __future__ import annotations

from specdecode.proposers.base import Draft, SequenceView
from specdecode.proposers.ngram_match import ngram_match


class NgramProposer:
    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def begin(self, seq: SequenceView) -> None:
        pass

    def propose(self, seq: SequenceView, k: int) -> Draft:
        return Draft(ngram_match(seq.token_ids, self.min_n, self.max_n, k))

    def on_verified(self, seq: SequenceView, num_accepted: int) -> None:
        pass

    def step_cost_hint(self) -> float:
        return 0.0
