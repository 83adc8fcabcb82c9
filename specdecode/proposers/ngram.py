"""Prompt lookup as a batch proposer: each row drafts the tokens that followed an earlier occurrence of its
current suffix. The lookup reads only the row's own tokens, so no row holds any state and nothing is ever
fed or measured: drafting is free."""

from __future__ import annotations

import torch

from specdecode.cost_model import CostModel
from specdecode.proposers.base import Capabilities, Draft, ProposeRow, SequenceView
from specdecode.proposers.ngram_match import ngram_match


class NgramRows:
    """A `BatchProposer` drafting every row's prompt-lookup chain (suffix n-grams of prompt_lookup_max down
    to prompt_lookup_min tokens)."""

    name = "ngram"
    capabilities = Capabilities(lookup=True)

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def configure(self, cost: CostModel) -> None:
        pass

    def reserve(self, rows: int) -> None:
        pass

    def begin(self, key: int, seq: SequenceView) -> None:
        pass

    def release(self, key: int) -> None:
        pass

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        return [Draft(ngram_match(r.seq.token_ids, self.min_n, self.max_n, r.k)) for r in rows]

    def observe_hidden(self, key: int, hidden: torch.Tensor) -> None:
        pass

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        pass

    def catch_up_tokens(self, key: int, seq: SequenceView) -> int:
        return 0

    def step_cost_hint(self) -> float:
        return 0.0

    def catch_up_token_seconds(self) -> float:
        return 0.0

    def state_bytes(self, rows: int) -> int:
        return 0
