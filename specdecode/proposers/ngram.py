"""Prompt lookup: draft the tokens that followed an earlier occurrence of the current suffix."""

from __future__ import annotations

from specdecode.proposers.base import Draft, ProposerDefaults, SequenceView
from specdecode.proposers.ngram_match import ngram_match


class NgramProposer(ProposerDefaults):
    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def begin(self, seq: SequenceView) -> None:
        pass

    def propose(self, seq: SequenceView, k: int, node_budget: int | None = None) -> Draft:
        return Draft(ngram_match(seq.token_ids, self.min_n, self.max_n, k))

    def on_verified(self, seq: SequenceView, num_accepted: int, own_accepted: int | None = None) -> None:
        pass
