"""Prompt lookup as a batch proposer: each row drafts the tokens that followed an earlier occurrence of its
current suffix. The lookup reads only the row's own tokens, so no row holds any state and nothing is ever
fed or measured: drafting is free."""

from __future__ import annotations

from specdecode.proposers.base import Draft, LookupRows, ProposeRow
from specdecode.proposers.ngram_match import ngram_match


class NgramRows(LookupRows):
    """A `BatchProposer` drafting every row's prompt-lookup chain (suffix n-grams of prompt_lookup_max down
    to prompt_lookup_min tokens)."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        return [Draft(ngram_match(r.seq.token_ids, self.min_n, self.max_n, r.k)) for r in rows]
