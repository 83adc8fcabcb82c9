"""The engine's batch proposer for a speculative config: which class drafts, over which model or head.

`LLM` loads the weights (the draft model, or a head attached to the target) and asks `proposer_factory` for a
function of the rows an engine runs at most, so `generate`'s engine and every server engine get drafting states
of their own over the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

from specdecode.config import SpeculativeConfig
from specdecode.heads.modules import DraftHead, EagleHead, MedusaHeads
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import BatchProposer
from specdecode.proposers.draft_rows import DraftModelRows
from specdecode.proposers.eagle_rows import EagleRows
from specdecode.proposers.medusa_rows import MedusaRows
from specdecode.proposers.ngram import NgramRows

ProposerFactory = Callable[[int], BatchProposer]
"""max rows -> a batch proposer with its own drafting states."""


def lookup_guess(spec: SpeculativeConfig | None) -> tuple[int, int] | None:
    """(min, max) suffix n-gram of the prompt-lookup guesses beside a drafter; None when they are off."""
    return (spec.prompt_lookup_min, spec.prompt_lookup_max) if spec and spec.draft_prompt_lookup else None


def proposer_factory(spec: SpeculativeConfig | None, max_len: int, draft: Transformer | None = None,
                     draft_vocab: tuple[int, int] | None = None, head: DraftHead | None = None
                     ) -> ProposerFactory | None:
    """The factory of batch proposers for `spec` (None without speculation). `draft`: the loaded draft model of
    the "draft" method, drafting over the target's ids (`draft_vocab`: its real and the target's row counts when
    they differ); `head`: the EAGLE or Medusa head attached to the target; `max_len`: the context length."""
    if spec is None:
        return None
    width, branching = spec.tree_width, spec.tree_branching
    if spec.method == "draft":
        assert draft is not None, "the draft method needs its loaded draft model"
        lookup = lookup_guess(spec)
        return lambda rows: DraftModelRows(draft, max_len, width, branching, lookup, vocab=draft_vocab,
                                           max_rows=rows)
    if isinstance(head, EagleHead):
        return lambda rows: EagleRows(head, max_len, width, branching, max_rows=rows)
    if isinstance(head, MedusaHeads):
        return lambda rows: MedusaRows(head, width, branching)
    lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
    return lambda rows: NgramRows(lo, hi)
